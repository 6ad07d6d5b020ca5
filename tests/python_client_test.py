"""The Python binding against a real offloadd, checked with torch 1.13.

Run by tests/python_client_test.sh (which starts the daemon)."""
import sys
import threading
import time
import unittest

import offloadd
import torch


class PythonClientTest(unittest.TestCase):
    def setUp(self):
        self.client = offloadd.Client()
        self.session = self.client.open_session("python-test")

    def tearDown(self):
        self.session.close()

    def register(self, name, values, **kw):
        p = self.session.register(name, values.numel(), **kw)
        torch.frombuffer(p.params, dtype=torch.float32).copy_(values)
        self.session.release([p.id])
        return p

    def return_grads(self, p, grad):
        g, = self.session.fetch([p.id], grads=True)
        torch.frombuffer(g.grads, dtype=torch.float32).copy_(grad)
        self.session.return_gradients(g)
        self.session.release([g.id])

    def params(self, p):
        q, = self.session.fetch([p.id])
        out = torch.frombuffer(q.params, dtype=torch.float32).clone()
        self.session.release([q.id])
        return out

    def test_handed_over_gradients_match_torch_and_keep_the_buffer(self):
        # hand_over: the step reads the gradients in the buffer (or, had the
        # buffer been fetched back first, the accumulator); the update is
        # torch's either way.
        gen = torch.Generator().manual_seed(3)
        w0 = torch.randn(3000, generator=gen)
        p = self.register("handed", w0)
        ref = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
        for step in range(3):
            grad = torch.randn(3000, generator=gen)
            g, = self.session.fetch([p.id], grads=True)
            torch.frombuffer(g.grads, dtype=torch.float32).copy_(grad)
            self.session.return_gradients([g], release=True, hand_over=True)
            if step == 1:
                back, = self.session.fetch([p.id], grads=True)  # taken back
                self.session.release([back.id])
            self.session.step(lr=1e-2, weight_decay=0.1)
            ref.grad = grad.clone()
            opt.step()
            torch.testing.assert_close(self.params(p), ref.detach(), rtol=1e-6, atol=1e-7)

    def test_gradient_stats_given_by_the_trainer_are_taken(self):
        # Handed over with the trainer's own statistics: the daemon adds them
        # up instead of reading the buffer (these are made up to show it),
        # and the step reads the buffer as usual.
        gen = torch.Generator().manual_seed(5)
        w0 = torch.randn(2000, generator=gen)
        p, q = self.register("given-a", w0), self.register("given-b", w0)
        ref = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
        grad = torch.randn(2000, generator=gen)
        views = self.session.fetch([p.id, q.id], grads=True)
        for v in views:
            torch.frombuffer(v.grads, dtype=torch.float32).copy_(grad)
        # Refused by the binding (no hand_over) and by the client (one
        # statistic per partition), then by the daemon (a negative norm).
        with self.assertRaises(offloadd.InvalidArgumentError):
            self.session.return_gradients(views, stats=[(1.0, 0), (2.0, 0)])
        with self.assertRaises(offloadd.InvalidArgumentError):
            self.session.return_gradients(views, hand_over=True, stats=[(1.0, 0)])
        with self.assertRaises(offloadd.InvalidArgumentError) as bad:
            self.session.return_gradients(views, hand_over=True, stats=[(1.0, 0), (-2.0, 0)])
        self.assertIn("negative", str(bad.exception))
        # The statistics are checked for all before any is returned: both
        # buffers are still held, and go again.
        self.assertIn("none of the 2", str(bad.exception))
        self.assertEqual(self.session.pending_gradients()["partitions"], 0)
        self.session.return_gradients(views, release=True, hand_over=True,
                                      stats=[(1.5, 0), (2.5, 0)])
        pending = self.session.pending_gradients()
        self.assertEqual(pending["sq_norm"], 4.0)
        self.assertEqual(pending["nonfinite"], 0)
        self.session.step(lr=1e-2, weight_decay=0.1)
        ref.grad = grad.clone()
        opt.step()
        for part in (p, q):
            torch.testing.assert_close(self.params(part), ref.detach(), rtol=1e-6, atol=1e-7)

    def test_adamw_with_accumulation_and_clipping_matches_torch(self):
        gen = torch.Generator().manual_seed(7)
        w0 = torch.randn(5000, generator=gen)
        p = self.register("w", w0)
        ref = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
        for step in range(5):
            g1 = torch.randn(5000, generator=gen)
            g2 = torch.randn(5000, generator=gen)
            # Two micro-batches; torch accumulates .grad the same way.
            self.return_grads(p, g1)
            self.return_grads(p, g2)
            ref.grad = g1.clone()
            ref.grad += g2
            pending = self.session.pending_gradients()
            self.assertEqual(pending["micro_batches"], 2)
            self.assertFalse(pending["delayed_update"])
            # Global clipping as clip_grad_norm_ does it (one rank here).
            total = pending["sq_norm"] ** 0.5
            torch_total = torch.nn.utils.clip_grad_norm_([ref], max_norm=50.0)
            self.assertAlmostEqual(total, torch_total.item(), delta=1e-5 * total)
            coef = min(1.0, 50.0 / (total + 1e-6))
            r = self.session.step(lr=1e-2, weight_decay=0.1, grad_scale=coef)
            self.assertEqual(r["partitions_updated"], 1)
            opt.step()
            mine = self.params(p)
            # The coefficient may differ from torch's in its last bit (its
            # norm is fp32, ours is summed in double): within 1e-6.
            torch.testing.assert_close(mine, ref.detach(), rtol=1e-6, atol=1e-7)

    def test_unclipped_steps_are_bit_identical_to_torch(self):
        gen = torch.Generator().manual_seed(3)
        w0 = torch.randn(4099, generator=gen)
        p = self.register("u", w0)
        ref = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([ref], lr=3e-3, weight_decay=0.01)
        for _ in range(4):
            g = torch.randn(4099, generator=gen)
            self.return_grads(p, g)
            ref.grad = g.clone()
            self.session.step(lr=3e-3, weight_decay=0.01)
            opt.step()
            self.assertTrue(torch.equal(self.params(p), ref.detach()))

    def test_param_groups_and_loss_scaling(self):
        gen = torch.Generator().manual_seed(5)
        w0, b0 = torch.randn(300, generator=gen), torch.randn(20, generator=gen)
        pw, pb = self.register("w", w0), self.register("b", b0)
        rw, rb = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
        opt = torch.optim.AdamW([{"params": [rw], "weight_decay": 0.1},
                                 {"params": [rb], "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2)
        for _ in range(3):
            gw, gb = torch.randn(300, generator=gen), torch.randn(20, generator=gen)
            self.return_grads(pw, gw)
            self.return_grads(pb, gb)
            rw.grad, rb.grad = gw.clone(), gb.clone()
            self.session.step(lr=1e-2, weight_decay=0.1,
                              groups=[{"ids": [pb.id], "weight_decay": 0.0, "lr": 5e-3}])
            opt.step()
            self.assertTrue(torch.equal(self.params(pw), rw.detach()))
            self.assertTrue(torch.equal(self.params(pb), rb.detach()))
        fp16 = self.client.open_session("fp16", loss_scaling={"initial_scale": 1024.0,
                                                              "hysteresis": 1})
        p = fp16.register("h", 8, param_dtype="fp16", grad_dtype="fp16")
        fp16.release([p.id])
        g, = fp16.fetch([p.id], grads=True)
        torch.frombuffer(g.grads, dtype=torch.float16).fill_(float("inf"))
        fp16.return_gradients(g)
        fp16.release([g.id])
        self.assertEqual(fp16.pending_gradients()["loss_scale"], 1024.0)
        r = fp16.step()
        self.assertTrue(r["skipped"])
        self.assertEqual(r["loss_scale"], 512.0)
        with self.assertRaises(offloadd.InvalidArgumentError):
            self.client.open_session("bad", loss_scaling={"backoff_factor": 2.0})
        fp16.close()

    def test_errors_carry_their_code(self):
        with self.assertRaises(offloadd.NotFoundError) as e:
            self.session.fetch([987654321])
        self.assertEqual(e.exception.code, "NOT_FOUND")
        with self.assertRaises(offloadd.InvalidArgumentError):
            self.session.register("bad", 10, param_dtype="int8")
        with self.assertRaises(offloadd.InvalidArgumentError):
            self.session.register("", 10)
        p = self.register("x", torch.zeros(10))
        q, = self.session.fetch([p.id])
        with self.assertRaises(offloadd.FailedPreconditionError):
            self.session.return_gradients(q)  # the gradient buffer is not held
        self.assertTrue(issubclass(offloadd.ResourceExhaustedError, offloadd.Error))
        with self.assertRaises(offloadd.UnavailableError):
            offloadd.Client("unix:/nonexistent/offloadd.sock")
        with self.assertRaises(offloadd.InvalidArgumentError):
            offloadd.open_device("cuda:x")
        with self.assertRaises(offloadd.InvalidArgumentError):
            offloadd.open_device("emulated", max_copy_delay_us=-1)
        self.assertEqual(offloadd.open_device("emulated", max_copy_delay_us=0).name, "emulated")
        # Arguments offloadd refuses are its errors, not the binding's
        # (IndexError, ValueError) or a crash (a device of None).
        with self.assertRaises(offloadd.InvalidArgumentError):
            offloadd.open_device("cuda:99999999999")
        with self.assertRaises(offloadd.InvalidArgumentError):
            self.session.write_moments(p.id, 1, 0, torch.zeros(4, dtype=torch.float64).numpy(),
                                       torch.zeros(4, dtype=torch.float64).numpy())
        # A count past the partition: the daemon's refusal, before memory
        # for it is asked for (2^40 floats: 4 TiB each).
        with self.assertRaises(offloadd.InvalidArgumentError):
            self.session.read_moments(p.id, 0, 1 << 40)
        dev = offloadd.open_device("emulated", memory_bytes=1 << 20, max_copy_delay_us=0)
        tier = offloadd.GpuTier(self.session, dev, budget_bytes=1 << 20, register_arena=False)
        unit = tier.add_unit([(p.id, 40)])
        for call in (lambda: tier.use(unit, 0, None), lambda: tier.done(unit, 0, None),
                     lambda: tier.use_units([unit], 0, None), lambda: tier.invalidate(0, None),
                     lambda: tier.add_gradient(p.id, 0, 40, 0, None)):
            with self.assertRaises(TypeError):
                call()
        del tier

    @staticmethod
    def other_thread_ticks_during(call):
        """How often another Python thread counted while `call()` ran, with
        a switch interval of a second: more than none only if `call`
        released the GIL."""
        ticks = [0]
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks[0] += 1

        old = sys.getswitchinterval()
        sys.setswitchinterval(1.0)
        try:
            t = threading.Thread(target=spin)
            t.start()
            time.sleep(0.05)  # the spinner holds the GIL at times; let it start
            before = ticks[0]
            call()
            during = ticks[0] - before
            stop.set()
            t.join()
        finally:
            sys.setswitchinterval(old)
        return during

    def test_blocking_calls_release_the_gil(self):
        # A step over 8M parameters takes milliseconds; another Python
        # thread runs during it.
        p = self.register("g", torch.ones(8 << 20))
        self.return_grads(p, torch.full((8 << 20,), 0.1))
        self.assertGreater(self.other_thread_ticks_during(self.session.step), 0)

    def test_a_tier_call_waiting_for_another_threads_use_releases_the_gil(self):
        # tier.stats() waits for the parameter cache's lock, which a use()
        # in another thread holds while its fetch waits for a step: a third
        # thread runs meanwhile (it wakes from a short sleep and needs the
        # GIL to say so), not only once stats() returns.
        n = 24 << 20
        p = self.register("tiered", torch.ones(n))
        dev = offloadd.open_device("emulated", memory_bytes=128 << 20, max_copy_delay_us=0)
        tier = offloadd.GpuTier(self.session, dev, budget_bytes=112 << 20,
                                register_arena=False, prefetch_depth=0)
        unit = tier.add_unit([(p.id, 4 * n)])
        for _ in range(3):
            self.return_grads(p, torch.full((n,), 0.1))
            self.session.step(overlap=True)  # its partition in the step: a fetch waits
            user = threading.Thread(target=lambda: tier.use(unit, 0, dev))
            user.start()
            woke = []
            other = threading.Thread(target=lambda: (time.sleep(0.002),
                                                     woke.append(time.monotonic())))
            other.start()
            began = time.monotonic()
            tier.stats()
            ended = time.monotonic()
            other.join()
            user.join(timeout=60)
            self.session.wait_step()
            tier.done(unit, 0, dev)
            if ended - began > 0.02:  # stats() had to wait
                self.assertLess(woke[0], ended - 0.005, "the GIL was held while stats() waited")
                del tier
                return
        del tier
        self.skipTest("each step ended before stats() had to wait")

    def test_partition_memory_outlives_its_session(self):
        # A partition's bytes (a memoryview, a tensor over it) taken from a
        # Session that closes or is collected stay mapped: stale, never a
        # fault that kills the interpreter. In a child: a crash is its own.
        import subprocess
        script = (
            "import gc, offloadd, torch\n"
            "client = offloadd.Client()\n"
            "s = client.open_session('outlived')\n"
            "p = s.register('w', 1024)\n"
            "view = p.params\n"
            "t = torch.frombuffer(view, dtype=torch.float32)\n"
            "t.fill_(2.0)\n"
            "s.close()\n"
            "del s\n"
            "gc.collect()\n"
            "print(float(t.sum()) in (0.0, 2048.0), len(bytes(p.params)))\n"
            "q = client.open_session('temporary').register('v', 16)\n"
            "gc.collect()\n"
            "print(len(bytes(q.params)))\n")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120)
        self.assertEqual(done.returncode, 0, f"the child died: {done.returncode}\n{done.stderr}")
        # (Stale: as written, or the zeros of pages the daemon gave back.)
        self.assertEqual(done.stdout.split(), ["True", "4096", "64"])

    def test_write_moments_keeps_its_buffers_exported_until_done(self):
        # write_moments reads its buffers without the GIL (here while it
        # waits for an overlapped step to end): they stay exported until it
        # returns, so another thread cannot resize one under it.
        import array
        n = 8 << 20
        p = self.register("moments", torch.zeros(n))
        self.return_grads(p, torch.full((n,), 0.5))
        for _ in range(3):
            m, v = array.array("f", bytes(4 * n)), array.array("f", bytes(4 * n))
            self.session.step(lr=1e-3, overlap=True)
            done, failed = threading.Event(), []

            def write():
                try:
                    self.session.write_moments(p.id, 1, 0, m, v)
                except (offloadd.Error, ValueError) as e:  # resized before its export: no verdict
                    failed.append(e)
                done.set()
            t = threading.Thread(target=write)
            t.start()
            time.sleep(0.01)
            try:
                m.append(1.0)
                resized = True
            except BufferError:
                resized = False
            still_writing = not done.is_set()
            t.join(timeout=60)
            self.session.wait_step()
            if not failed and (still_writing or not resized):
                self.assertFalse(resized and still_writing, "resized while being written")
                return
            self.return_grads(p, torch.full((n,), 0.5))  # no verdict this round: again
        self.skipTest("each step ended before the write was looked at")

    def test_a_session_collected_unclosed_closes_without_the_gil(self):
        # A Session collected without close() closes itself (a call to
        # offloadd); another Python thread runs meanwhile. (The close is
        # short: on a loaded machine the other thread may not be scheduled
        # within it, so up to five sessions are tried; holding the GIL, not
        # one lets it run.)
        during, ids = 0, []
        while during == 0 and len(ids) < 5:
            holder = [self.client.open_session("collected")]
            holder[0].register("c", 4 << 20)
            ids.append(holder[0].id)
            during = self.other_thread_ticks_during(holder.clear)
        self.assertGreater(during, 0)
        open_ids = [s["id"] for s in self.client.stats()["sessions"]]
        for i in ids:
            self.assertNotIn(i, open_ids)

    def test_a_tier_collected_lets_its_copies_end_without_the_gil(self):
        # A GpuTier's destructor waits for its copies in flight (here up to
        # 300 ms each on the emulated device) and lets its holds go: another
        # Python thread runs meanwhile.
        n = 1 << 20
        p = self.register("collected-tier", torch.ones(n))
        dev = offloadd.open_device("emulated", memory_bytes=16 << 20, max_copy_delay_us=300000)
        # (Each copy's delay is random: up to five tiers are tried.)
        during, tries = 0, 0
        while during == 0 and tries < 5:
            tries += 1
            holder = [offloadd.GpuTier(self.session, dev, budget_bytes=16 << 20,
                                       register_arena=False, prefetch_depth=0)]
            unit = holder[0].add_unit([(p.id, 4 * n)])
            holder[0].begin_iteration()
            holder[0].use(unit, 0, dev)  # its copy in flight
            during = self.other_thread_ticks_during(holder.clear)
        self.assertGreater(during, 0)

    def test_a_forked_child_leaves_its_parents_tier_alone(self):
        # A data loader's worker forked with a GpuTier in memory drops its
        # copy when it ends: the parent's holds stay, its iteration ends.
        import os
        p = self.register("forked-tier", torch.ones(1024))
        dev = offloadd.open_device("emulated", memory_bytes=1 << 20, max_copy_delay_us=0)
        tier = offloadd.GpuTier(self.session, dev, budget_bytes=1 << 20, register_arena=False,
                                hold_per_iteration=True)
        unit = tier.add_unit([(p.id, 4096)])
        tier.begin_iteration()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                del tier
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertTrue(os.WIFEXITED(status), f"the child died: status {status}")
        self.assertEqual(os.WEXITSTATUS(status), 0)
        tier.use(unit, 0, dev)
        tier.done(unit, 0, dev)
        tier.end_iteration()  # its holds were still its own
        del tier

    def test_a_session_closed_by_two_threads_at_once(self):
        # Session is safe from several threads: two closing it at once both
        # return (its keepalive thread is stopped once).
        for _ in range(5):
            s = self.client.open_session("closed-twice")
            threads = [threading.Thread(target=s.close) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=20)
            self.assertFalse(any(t.is_alive() for t in threads), "a close never returned")

    def test_a_trainer_that_dies_is_seen_gone_while_its_forked_child_lives(self):
        # The arena connection is offloadd's sign that the trainer lives: a
        # child forked from it (a data loader's worker) does not keep it
        # open, so that a trainer killed while its child runs on has its
        # holds released at once (the session detached), not when the
        # child ends.
        import os
        import signal
        import subprocess
        script = (
            "import os, signal, sys, time\n"
            "import offloadd\n"
            "s = offloadd.Client().open_session('forked-then-killed')\n"
            "p = s.register('w', 1024)\n"  # held from registration on
            "child = os.fork()\n"
            "if child == 0:\n"
            "    time.sleep(60)\n"
            "    os._exit(0)\n"
            "print(s.id, child, flush=True)\n"
            "sys.stdin.readline()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
        trainer = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        child = None
        try:
            session_id, child = (int(x) for x in trainer.stdout.readline().split())

            def held():
                for s in self.client.stats()["sessions"]:
                    if s["id"] == session_id:
                        return s["held"]
                return 0
            self.assertEqual(held(), 1)
            trainer.stdin.write("\n")
            trainer.stdin.flush()
            trainer.wait(timeout=20)
            deadline = time.monotonic() + 10
            while held() != 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(held(), 0, "the forked child kept the dead trainer's session attached")
            os.kill(child, 0)  # (the child still lives)
        finally:
            trainer.kill()
            if child is not None:
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def test_a_forked_child_leaves_its_parents_session_alone(self):
        # A data loader's worker forked with the session in memory drops its
        # copy when it ends: the parent's session stays open and works.
        import os
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                del self.session
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertTrue(os.WIFEXITED(status), f"the child died: status {status}")
        self.assertEqual(os.WEXITSTATUS(status), 0)
        self.session.pending_gradients()  # still open
        names = [x["name"] for x in self.client.stats()["sessions"]]
        self.assertIn("python-test", names)


if __name__ == "__main__":
    unittest.main()
