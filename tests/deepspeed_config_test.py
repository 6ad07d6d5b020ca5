"""offloadd.deepspeed: every supported DeepSpeed field maps to offloadd's
settings; an unsupported one is an InvalidArgumentError naming it; one
without meaning here is accepted with a note saying why."""
import json
import logging
import os
import tempfile
import unittest

import offloadd
from offloadd import deepspeed

ZERO3 = {"zero_optimization": {"stage": 3}}


def t(extra, **kw):
    cfg = json.loads(json.dumps(ZERO3))
    for k, v in extra.items():
        if k == "zero_optimization":
            cfg[k].update(v)
        else:
            cfg[k] = v
    return deepspeed.translate(cfg, **kw)


class DeepSpeedConfigTest(unittest.TestCase):
    def assert_rejected(self, extra, field):
        with self.assertRaises(offloadd.InvalidArgumentError) as e:
            t(extra)
        self.assertIn(f"'{field}'", str(e.exception))
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")

    def test_offload_devices_map_to_placement(self):
        r = t({"zero_optimization": {"offload_optimizer": {"device": "nvme"},
                                     "offload_param": {"device": "cpu"}}})
        self.assertEqual(r.zero["placement"], {"optimizer_state": "nvme", "params": "host"})
        r = t({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.0},
                                     "offload_param": {"device": "nvme"}}})
        self.assertEqual(r.zero["placement"], {"optimizer_state": "host", "params": "nvme"})
        r = t({"zero_optimization": {"offload_param": {"device": "none"}}})
        self.assertEqual(r.zero["placement"], {"params": "host"})
        self.assertTrue(any("offload_param.device" in n for n in r.notes))
        r = t({"zero_optimization": {"cpu_offload": True}})
        self.assertEqual(r.zero["placement"], {"optimizer_state": "host"})

    def test_buffer_and_path_fields_are_accepted_with_a_reason(self):
        fields = {"nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                  "buffer_size": 1e8, "max_in_cpu": 1e9}
        r = t({"zero_optimization": {
            "offload_param": dict(fields, device="nvme"),
            "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 4,
                                  "pin_memory": True, "fast_init": False, "pipeline_read": True,
                                  "pipeline_write": True},
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "reduce_bucket_size": 5e8, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True}})
        for f in fields:
            self.assertTrue(any(n.startswith(f"zero_optimization.offload_param.{f}: accepted")
                                for n in r.notes), f)
        self.assertTrue(any("buffer_count" in n and "one host pool per node" in n
                            for n in r.notes))
        self.assertTrue(any("stage3_max_reuse_distance" in n and "Belady" in n
                            for n in r.notes))
        self.assertEqual(r.zero["gpu"], {"max_live_parameters": 10**9,
                                         "max_reuse_distance": 10**9,
                                         "persistence_threshold": 10**5})
        # The job's own bucket for averaging gradients across ranks.
        self.assertEqual(r.zero["reduce_bucket_elements"], 5 * 10**8)
        self.assertFalse(any(n.startswith("zero_optimization.reduce_bucket_size")
                             for n in r.notes))

    def test_prefetch_bucket_sets_this_jobs_gpu_prefetch_not_the_node(self):
        r = t({"zero_optimization": {"stage3_prefetch_bucket_size": 50000000}})
        self.assertEqual(r.zero["gpu"], {"prefetch_elements": 50000000})
        self.assertNotIn("node_tunables", r.zero)
        self.assertTrue(any("this job's gpu.prefetch_elements" in n for n in r.notes))
        # Said as applied, not as ignored.
        self.assertTrue(any(n.startswith("zero_optimization.stage3_prefetch_bucket_size: applied:")
                            for n in r.notes), r.notes)
        self.assertFalse(any("stage3_prefetch_bucket_size: accepted and ignored" in n
                             for n in r.notes), r.notes)

    def test_optimizer_section(self):
        r = t({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.8, 0.99],
                                                         "eps": 1e-6, "weight_decay": 0.05}}})
        self.assertEqual(r.adamw, {"adamw": True, "lr": 1e-4, "betas": (0.8, 0.99),
                                   "eps": 1e-6, "weight_decay": 0.05})
        # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
        self.assertTrue(t({"optimizer": {"type": "Adam", "params": {}}}).adamw["adamw"])
        # DeepSpeed's default weight decay is 0 (torch's AdamW's is 0.01).
        self.assertEqual(t({"optimizer": {"type": "AdamW", "params": {"lr": 1}}})
                         .adamw["weight_decay"], 0.0)
        self.assertFalse(t({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
                         .adamw["adamw"])
        self.assert_rejected({"optimizer": {"type": "Lamb"}}, "optimizer.type")
        self.assert_rejected({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
                             "optimizer.params.amsgrad")
        self.assert_rejected({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
                             "optimizer.params.bias_correction")

    def test_fp16_bf16_clipping_and_accumulation(self):
        r = t({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500,
                        "hysteresis": 3, "min_loss_scale": 2}})
        self.assertEqual(r.zero["working_dtype"], "fp16")
        self.assertEqual(r.zero["loss_scaling"], {"initial_scale": 4096.0, "growth_interval": 500,
                                                  "hysteresis": 3, "min_scale": 2.0})
        r = t({"fp16": {"enabled": True, "loss_scale": 128}})
        self.assertEqual(r.zero["static_loss_scale"], 128.0)
        self.assertNotIn("loss_scaling", r.zero)
        self.assertNotIn("working_dtype", t({"fp16": {"enabled": False}}).zero)
        self.assertEqual(t({"bf16": {"enabled": True}}).zero["working_dtype"], "bf16")
        self.assert_rejected({"bf16": {"enabled": True}, "fp16": {"enabled": True}},
                             "bf16.enabled")
        self.assert_rejected({"fp16": {"enabled": True, "consecutive_hysteresis": True}},
                             "fp16.consecutive_hysteresis")
        r = t({"gradient_clipping": 1.0, "gradient_accumulation_steps": 4})
        self.assertEqual((r.zero["gradient_clipping"], r.zero["gradient_accumulation_steps"]),
                         (1.0, 4))
        # Derived as DeepSpeed does: batch = micro batch x accumulation x ranks.
        r = t({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, world_size=2)
        self.assertEqual(r.zero["gradient_accumulation_steps"], 8)
        self.assert_rejected({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
                             "train_batch_size")
        # All three given: they must agree, as DeepSpeed checks.
        self.assert_rejected({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 4}, "train_batch_size")
        self.assertEqual(t({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                            "gradient_accumulation_steps": 4}, world_size=2)
                         .zero["gradient_accumulation_steps"], 4)

    def test_values_read_as_deepspeed_reads_them(self):
        # torch_adam builds torch's AdamW in DeepSpeed: its weight decay 0.01.
        r = t({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}})
        self.assertEqual((r.adamw["adamw"], r.adamw["weight_decay"]), (True, 0.01))
        r = t({"optimizer": {"type": "Adam", "params": {"torch_adam": True,
                                                        "adam_w_mode": False}}})
        self.assertEqual((r.adamw["adamw"], r.adamw["weight_decay"]), (False, 0.0))
        self.assertEqual(t({"optimizer": {"type": "AdamW"}}).adamw["weight_decay"], 0.0)
        self.assertTrue(t({"optimizer": {"type": "AdamW"}}).has_optimizer)
        self.assertFalse(t({}).has_optimizer)
        # 0 means no prefetch and as few live parameters as can be.
        r = t({"zero_optimization": {"stage3_prefetch_bucket_size": 0,
                                     "stage3_max_live_parameters": 0}})
        self.assertEqual(r.zero["gpu"], {"prefetch_depth": 0, "max_live_parameters": 1})
        self.assert_rejected({"zero_optimization": {"stage3_max_live_parameters": -1}},
                             "zero_optimization.stage3_max_live_parameters")
        self.assert_rejected({"zero_optimization": {"stage3_prefetch_bucket_size": "5e8"}},
                             "zero_optimization.stage3_prefetch_bucket_size")
        # The batch sizes used are said so, not "ignored".
        r = t({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, world_size=2)
        self.assertTrue(any(n.startswith("train_batch_size: applied: sets "
                                         "gradient_accumulation_steps 8") for n in r.notes),
                        r.notes)
        self.assertFalse(any("ignored" in n for n in r.notes), r.notes)
        self.assertTrue(any(n.startswith("train_batch_size: applied: the engine's")
                            for n in t({"train_batch_size": 64}).notes))
        # A batch that the accumulation and ranks do not divide, and counts
        # that are not positive whole numbers, name their own field.
        self.assert_rejected({"train_batch_size": 10, "gradient_accumulation_steps": 4},
                             "train_batch_size")
        self.assertEqual(t({"train_batch_size": 16, "gradient_accumulation_steps": 4},
                           world_size=2).zero["gradient_accumulation_steps"], 4)
        self.assert_rejected({"train_batch_size": 0, "train_micro_batch_size_per_gpu": 4},
                             "train_batch_size")
        self.assert_rejected({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps")
        self.assertEqual(t({"gradient_accumulation_steps": 2.0})
                         .zero["gradient_accumulation_steps"], 2)
        # help(offloadd.deepspeed) lists the fields.
        for field in ("stage3_max_live_parameters", "buffer_count", "steps_per_print",
                      "Refused by name"):
            self.assertIn(field, deepspeed.__doc__)

    def test_unsupported_fields_are_named(self):
        with self.assertRaises(offloadd.InvalidArgumentError) as e:
            deepspeed.translate({"zero_optimization": {"stage": 2}})
        self.assertIn("'zero_optimization.stage'", str(e.exception))
        with self.assertRaises(offloadd.InvalidArgumentError):
            deepspeed.translate({"optimizer": {"type": "AdamW"}})  # no zero_optimization
        self.assert_rejected({"scheduler": {"type": "WarmupLR"}}, "scheduler")
        self.assert_rejected({"amp": {"enabled": True}}, "amp")
        self.assert_rejected({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
                             "zero_optimization.offload_optimizer.device")
        self.assert_rejected({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                                          "ratio": 0.3}}},
                             "zero_optimization.offload_optimizer.ratio")
        self.assert_rejected({"zero_optimization": {"offload_param": {"device": "cpu",
                                                                      "bogus": 1}}},
                             "zero_optimization.offload_param.bogus")
        self.assert_rejected({"zero_optimization": {"stage3_bogus": 1}},
                             "zero_optimization.stage3_bogus")
        # Hugging Face's "auto" placeholders are named, not misread.
        self.assert_rejected({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                             "optimizer.params.lr")
        self.assert_rejected({"fp16": {"enabled": "auto"}}, "fp16.enabled")

    def test_every_field_refused_is_named_at_once(self):
        # Hugging Face's stock ZeRO-3 config: its "auto" values all in one
        # error (they were named one a run: 17 runs), with the other fields
        # offloadd cannot take.
        hf = {"fp16": {"enabled": "auto", "loss_scale": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                        "eps": "auto", "weight_decay": "auto"}},
              "zero_optimization": {"stage": 3, "overlap_comm": True,
                                    "stage3_prefetch_bucket_size": "auto",
                                    "reduce_bucket_size": "auto"},
              "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
              "train_micro_batch_size_per_gpu": "auto", "bogus": 1}
        with self.assertRaises(offloadd.InvalidArgumentError) as e:
            deepspeed.translate(hf)
        message = str(e.exception)
        for field in ("fp16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                      "optimizer.params.weight_decay", "zero_optimization.reduce_bucket_size",
                      "zero_optimization.stage3_prefetch_bucket_size", "train_batch_size",
                      "gradient_accumulation_steps", "bogus"):
            self.assertIn(f"'{field}'", message)
        self.assertIn("11 fields offloadd cannot take", message)
        # An "auto" stage or optimizer type is named once, for being "auto".
        with self.assertRaises(offloadd.InvalidArgumentError) as e:
            deepspeed.translate({"zero_optimization": {"stage": "auto"},
                                 "optimizer": {"type": "auto"}})
        self.assertIn("2 fields", str(e.exception))
        self.assertEqual(message.count("'optimizer.params.lr'"), 1, message)  # once each

    def test_values_of_the_wrong_type_are_named(self):
        for extra, field in (
                ({"zero_optimization": {"offload_optimizer": "cpu"}},
                 "zero_optimization.offload_optimizer"),
                ({"fp16": True}, "fp16"),
                ({"fp16": None}, "fp16"),
                ({"optimizer": "AdamW"}, "optimizer"),
                ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}},
                 "optimizer.params.betas"),
                ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99, 0.9]}}},
                 "optimizer.params.betas"),
                ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}},
                 "optimizer.params.betas"),
                ({"optimizer": {"type": "AdamW", "params": {"weight_decay": True}}},
                 "optimizer.params.weight_decay"),
                ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}},
                 "optimizer.params.lr"),
                ({"gradient_clipping": {"max": 1}}, "gradient_clipping"),
                ({"gradient_clipping": None}, "gradient_clipping"),
                ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
                ({"fp16": {"enabled": True, "initial_scale_power": "16"}},
                 "fp16.initial_scale_power"),
                ({"fp16": {"enabled": "maybe"}}, "fp16.enabled"),
                ({"zero_optimization": {"reduce_bucket_size": 0}},
                 "zero_optimization.reduce_bucket_size")):
            with self.subTest(extra=extra):
                self.assert_rejected(extra, field)
        with self.assertRaises(offloadd.InvalidArgumentError) as e:
            deepspeed.translate({"zero_optimization": {"stage": "3"}})
        self.assertIn("'3' is text: give the number 3", str(e.exception))

    def test_booleans_as_deepspeed_reads_them(self):
        # "false" as text is false (it turned fp16 on), as DeepSpeed's config
        # model reads it.
        for off in (False, "false", "False", 0, "no", "off"):
            self.assertNotIn("working_dtype", t({"fp16": {"enabled": off}}).zero, off)
            self.assertNotIn("working_dtype", t({"bf16": {"enabled": off}}).zero, off)
        for on in (True, "true", 1, "yes"):
            self.assertEqual(t({"bf16": {"enabled": on}}).zero["working_dtype"], "bf16", on)
        self.assertEqual(t({"zero_optimization": {"cpu_offload": "false"}}).zero["placement"], {})

    def test_fields_at_their_default_are_taken_and_others_named(self):
        # What Megatron's and others' configs carry at DeepSpeed's defaults
        # (each refused before, one a run).
        r = t({"prescale_gradients": False, "gradient_predivide_factor": 1.0,
               "sparse_gradients": False, "memory_breakdown": False,
               "activation_checkpointing": {"partition_activations": False,
                                            "contiguous_memory_optimization": False},
               "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": None,
               "curriculum_learning": {"enabled": False},
               "bfloat16": {"enabled": True, "immediate_grad_update": False},
               "zero_optimization": {"zero_quantized_weights": False,
                                     "zero_quantized_gradients": False,
                                     "zero_hpz_partition_size": 1}})
        self.assertEqual(r.zero["working_dtype"], "bf16")  # (bfloat16: bf16's other name)
        for field in ("prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
                      "activation_checkpointing", "data_types.grad_accum_dtype",
                      "communication_data_type", "curriculum_learning",
                      "bfloat16.immediate_grad_update", "zero_optimization.zero_hpz_partition_size",
                      "zero_optimization.zero_quantized_weights"):
            self.assertTrue(any(n.startswith(f"{field}: accepted and ignored") for n in r.notes),
                            field)
        for extra, field in (({"prescale_gradients": True}, "prescale_gradients"),
                             ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
                             ({"curriculum_learning": {"enabled": True}},
                              "curriculum_learning.enabled"),
                             ({"communication_data_type": "fp16"}, "communication_data_type"),
                             ({"data_types": {"grad_accum_dtype": "bf16"}},
                              "data_types.grad_accum_dtype"),
                             ({"zero_optimization": {"zero_quantized_weights": True}},
                              "zero_optimization.zero_quantized_weights"),
                             ({"zero_optimization": {"zero_hpz_partition_size": 8}},
                              "zero_optimization.zero_hpz_partition_size")):
            with self.subTest(field=field):
                self.assert_rejected(extra, field)

    def test_batch_sizes_and_nvme_path_are_kept_for_the_engine(self):
        self.assertTrue(t({"dataloader_drop_last": True}).drop_last)
        self.assertFalse(t({}).drop_last)
        r = t({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, world_size=2)
        self.assertEqual(r.batch_sizes, (64, 4))
        r = t({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
              world_size=2)
        self.assertEqual(r.batch_sizes, (16, 4))
        r = t({"zero_optimization": {"offload_optimizer": {"device": "nvme",
                                                           "nvme_path": "/local_nvme"}}})
        self.assertEqual(r.nvme_path, "/local_nvme")

    def test_a_config_honoured_whole_logs_at_info(self):
        # Nothing ignored: no WARNING (it printed one a rank for a config
        # taken whole).
        cfg = {"zero_optimization": {"stage": 3}, "train_batch_size": 8,
               "train_micro_batch_size_per_gpu": 4}
        with self.assertLogs("offloadd.deepspeed", level="INFO") as logs:
            deepspeed.from_config(cfg, world_size=2)
        self.assertEqual([r.levelname for r in logs.records], ["INFO"])

    def test_json_file_and_logged_notes(self):
        cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                         "buffer_count": 4}},
               "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
               "steps_per_print": 10}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(cfg, f)
        try:
            # One line at info level naming the fields; each note at debug.
            with self.assertLogs("offloadd.deepspeed", level="INFO") as logs:
                adamw, zero = deepspeed.from_config(f.name)
            with self.assertLogs("offloadd.deepspeed", level="DEBUG") as debug:
                deepspeed.from_config(f.name)
        finally:
            os.unlink(f.name)
        self.assertEqual(adamw["lr"], 0.01)
        self.assertEqual(zero["placement"], {"optimizer_state": "nvme"})
        self.assertEqual(len(logs.output), 1, logs.output)
        self.assertIn("buffer_count", logs.output[0])
        self.assertIn("steps_per_print", logs.output[0])
        self.assertIn("2 field(s) accepted and ignored", logs.output[0])
        self.assertNotIn("applied", logs.output[0])
        self.assertGreater(len(debug.output), 1)
        self.assertTrue(any("accepted and ignored" in line for line in debug.output))


if __name__ == "__main__":
    logging.basicConfig()
    unittest.main(verbosity=2)
