#!/usr/bin/env bash
# Runs, on a GPU machine, what tools/gpu_bundle.sh packed: the CUDA system
# test, the system tests with that machine's PyTorch, and the benchmarks.
# usage: tools/gpu_run.sh BUNDLE STAGE...   (from any directory)
# Stages: env doctor cudatest nccltest gpudemo gpucopy gputier gputier_cuda gputier_dpu gputest compat
#         alltests tokens tokens_big tokens_host tokens_ab tokens_profile tokens_trace large
#         step_overlap step_overlap_3t
#         step_overlap_15 step_overlap_12 step_overlap_nvme
#         load1 load1_nosteps load8 cpu_adam shares shares_nvme shares_neighbour
# Each stage prints "=== STAGE rc=N" at its end; a failing stage does not
# stop the others.
set -uo pipefail
bundle=$(cd "${1:?usage: tools/gpu_run.sh BUNDLE STAGE...}" && pwd)
shift
# NCCL is the target's PyTorch's (the bundle leaves it out).
nccl=$(find $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
         -name 'libnccl.so.2' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$bundle/lib${nccl:+:$(dirname "$nccl")} PYTHONUNBUFFERED=1
export PYTHONPATH=client/python/site
# The demo's training text, where the tests and benchmarks look for it.
[[ -f /usr/share/common-licenses/GPL-3 ]] ||
  { mkdir -p /usr/share/common-licenses && cp "$bundle/GPL-3" /usr/share/common-licenses/; }
cd "$bundle/run"
failed=0
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env)
      nproc; free -g | head -2; nvidia-smi -L; python3 -V
      python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
      df -hT /tmp /var/tmp | cat; lscpu | grep -E 'Model name|^CPU\(s\)|L3'
      ! ldd daemon/offloadd client/python/site/offloadd/_offloadd.so | grep 'not found' ;;
    # offloadctl doctor on a GPU node (exit 1: something to tune, not broken).
    doctor)
      timeout 60 client/offloadctl doctor --server.data_dir=/tmp/offloadd-doctor
      rc=$?; (( rc <= 1 )) ;;
    cudatest) timeout 60 gpu/cuda_device_test ;;
    nccltest) timeout 60 gpu/nccl_communicator_test ;;
    # The C++ GPU demo: ZeRO-3 over NCCL (one rank) through a fresh offloadd.
    gpudemo)
      g=/tmp/offloadd-gpudemo; rm -rf $g
      daemon/offloadd --server.data_dir=$g > $g.log 2>&1 & d=$!
      tests/wait_for_daemon $d $g.log $g/offloadd.sock &&
        timeout 120 client/demo/offload_gpu_demo --device=cuda \
          --address=unix:$g/offloadd.sock
      rc=$?; kill $d; wait $d; (exit $rc) ;;
    gpucopy) timeout 120 benches/gpu_copy --bytes=1073741824 ;;
    gputier)
      timeout 300 python3 tests/torch_wrap_test.py -v \
        TorchWrapTest.test_gpu_tier_on_cuda_matches_torch_adamw_on_the_gpu \
        TorchWrapTest.test_gpu_tier_on_the_emulated_device \
        TorchWrapTest.test_torch_transformer_layers_train_as_units ;;
    gputier_cuda)
      timeout 200 python3 tests/torch_wrap_test.py -v \
        TorchWrapTest.test_gpu_tier_on_cuda_matches_torch_adamw_on_the_gpu ;;
    gputier_dpu)
      timeout 200 python3 tests/torch_wrap_test.py -v \
        TorchWrapTest.test_gpu_tier_with_the_delayed_update_on_cuda ;;
    # A GPT past GPU-resident AdamW on an 80 GB GPU (LARGE_ARGS: more flags,
    # --gpu_memory_gib=78 on a larger GPU, say).
    large) timeout 480 python3 benches/larger_than_gpu.py --offloadd=daemon/offloadd ${LARGE_ARGS:-} ;;
    gputest) timeout 300 python3 tests/torch_wrap_test.py -v TorchWrapTest.test_on_gpus_with_nccl ;;
    # torch's own modules through wrap on the GPU (the GPU tier) against
    # torch AdamW stepping on the host (1e-5) and on the GPU (as close as
    # torch's own host AdamW is to it).
    compat)
      OFFLOADD_TEST_DEVICE=cuda CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 200 python3 tests/torch_wrap_test.py -v \
        WrapInProcessTest.test_recurrent_layers WrapInProcessTest.test_convolutions_with_batch_norm_buffers \
        WrapInProcessTest.test_attention_and_transformer_modules WrapInProcessTest.test_tied_embedding_and_head \
        WrapInProcessTest.test_frozen_parameters_stay_as_they_were \
        WrapInProcessTest.test_a_parameter_shared_by_a_module_and_its_child \
        WrapInProcessTest.test_thousands_of_small_tensors_take_a_few_mappings \
        WrapInProcessTest.test_a_module_run_twice_lets_its_parameters_go_after_each_backward \
        WrapInProcessTest.test_a_budget_of_what_nesting_holds_trains \
        WrapInProcessTest.test_a_module_changing_its_input_in_place_trains_like_torch_under_a_small_budget \
        WrapInProcessTest.test_a_forward_that_raised_leaves_no_parameters_in_use \
        WrapInProcessTest.test_persistent_parameters_at_the_least_budget \
        WrapInProcessTest.test_random_nested_models_train_at_the_least_budget \
        WrapInProcessTest.test_reentrant_checkpointing_of_a_block_that_saves_its_weight \
        WrapInProcessTest.test_a_module_returning_a_view_of_its_parameter_under_a_small_budget \
        WrapInProcessTest.test_a_cap_on_live_parameters_at_the_least_budget \
        WrapInProcessTest.test_frozen_parameters_of_a_recomputed_block_go_after_its_backward \
        WrapInProcessTest.test_an_encoder_decoder_transformer_trains_at_the_least_budget \
        WrapInProcessTest.test_an_embedding_called_twice_trains_at_every_budget_wrap_takes ;;
    alltests) timeout 500 python3 tests/torch_wrap_test.py ;;
    tokens) timeout 300 python3 benches/torch_tokens.py --offloadd=daemon/offloadd --device=cuda ;;
    tokens_profile)
      timeout 200 python3 benches/torch_tokens.py --offloadd=daemon/offloadd --device=cuda \
        --dim=512 --layers=8 --batch=32 --context=128 --steps=20 --profile ;;
    tokens_trace)
      timeout 200 python3 benches/torch_tokens.py --offloadd=daemon/offloadd --device=cuda \
        --dim=512 --layers=8 --batch=32 --context=128 --steps=10 --warmup=3 --trace ;;
    tokens_big)
      timeout 400 python3 benches/torch_tokens.py --offloadd=daemon/offloadd --device=cuda \
        --dim=512 --layers=8 --batch=32 --context=128 --steps=20 --rounds=2 ;;
    # The 25M model, state on the host only (sync, delayed update, overlapped).
    tokens_host)
      timeout 300 python3 benches/torch_tokens.py --offloadd=daemon/offloadd --device=cuda \
        --dim=512 --layers=8 --batch=32 --context=128 --steps=20 --rounds=2 \
        --modes=torch,host,dpu,overlap ;;
    # This tree's offloadd.torch against OLD_REV's (gpu_bundle.sh), the
    # same binaries, alternating: 3 pairs of the 25M model, sync and delayed.
    tokens_ab)
      [[ -d site_old ]] || { echo "no site_old: bundle with OLD_REV=<commit>"; false; } &&
      for r in 1 2 3; do
        for v in new old; do
          site=client/python/site; [[ $v == old ]] && site=site_old
          echo "== $v $r"
          PYTHONPATH=$site timeout 90 python3 benches/torch_tokens.py --offloadd=daemon/offloadd \
            --device=cuda --dim=512 --layers=8 --batch=32 --context=128 --steps=20 --rounds=1 \
            --modes=host,dpu 2>&1 | grep -E "^torch AdamW|^offloadd, state|^  the same|rror"
        done
      done ;;
    step_overlap) timeout 300 benches/step_overlap ;;
    step_overlap_3t) timeout 300 benches/step_overlap --t=70ms ;;
    step_overlap_15) timeout 300 benches/step_overlap --threads=15 ;;
    step_overlap_12) timeout 300 benches/step_overlap --threads=12 ;;
    step_overlap_nvme) timeout 400 benches/step_overlap --nvme ;;
    load1) timeout 60 benches/load --trainers=1 --seconds=5 ;;
    load1_nosteps) timeout 60 benches/load --trainers=1 --seconds=5 --step_every=1000000000 ;;
    load8) timeout 60 benches/load --trainers=8 --seconds=5 ;;
    cpu_adam) timeout 300 benches/cpu_adam --peer=none --threads=1,8,16 ;;
    # Issue 31 on 16 cores: the optimizer's and the pool's shares by weight,
    # and a session beside a neighbour swapping from NVMe (its swap space
    # beside the bundle: on the machine's disk, where O_DIRECT works).
    shares) timeout 120 benches/shares ;;
    # (--timeline: each second's updates, room and turns' traces by session.)
    shares_nvme) mkdir -p "$bundle/../sn" && timeout 180 benches/shares --state-on-nvme="$bundle/../sn" --seconds=10 --timeline ;;
    shares_neighbour) mkdir -p "$bundle/../nb" && timeout 180 benches/shares --neighbour="$bundle/../nb" ;;
    *) echo "unknown stage $stage"; false ;;
  esac
  rc=$?
  echo "=== $stage rc=$rc $(date +%T)"
  [[ $rc == 0 ]] || failed=1
done
exit $failed
