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
        self.assertTrue(any(n.startswith("train_batch_size: accepted and ignored")
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
