"""One process of ``benchmarks/accumulator.py`` (not run by hand): a cohort member
(``swarmavg.aio.accumulator.Accumulator`` over TCP on 127.0.0.1, plain unless ``encryption``,
``torch.set_num_threads(1)``) or, in mode ``local``, the one-process reference of the
convergence figure. The driver passes one JSON object as the only argument; this process writes
JSON lines on stdout (``started`` with its address, then one ``result``, or ``error``) and exits.

Modes:

- ``latency``: one float32 parameter of ``size`` elements, gradient all ones,
  ``virtual_batch_size = peers`` (each count decides); ``warmup`` untimed rounds, then ``rounds``
  timed ones: ``perf_counter`` and ``process_time`` around ``await reduce_gradients(1)`` (it
  returns with the result in ``.grad``), then ``zero_gradients()``. Reports every round's
  seconds and this process's CPU seconds over it (all its threads).
- ``throughput``: the same with ``set_parallel_gradients(parallel)`` and ``wait=False``: for
  ``duration`` seconds after a start time the driver gives, contribute whenever
  ``wants_gradients()`` and read every result; reports results applied in the window, its
  contributions, and the cohort's epoch changes and failed all-reduces over the window (each one
  loses the rounds in flight).
- ``convergence``: the workload's model (``make_model(seed=0)``), Adam, batches of ``batch``
  from the sharded stream (peer ``index`` of ``peers``: together they draw exactly one process's
  batch ``peers * batch``), ``virtual_batch_size = peers * batch``; ``steps`` results; the
  validation loss every ``eval_every`` results (``index`` 0 only).
- ``local``: the same model and optimizer in this process alone, batch ``peers * batch`` from the
  same stream, ``steps`` steps, the same evaluations.

Before a cohort's timed part every member waits until its epoch holds all ``peers`` members and
it is connected (a member that started alone might otherwise apply results of its own first).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def cohort(cfg: dict[str, Any]) -> None:
    import anyio
    import torch

    from swarmavg.aio import DHT
    from swarmavg.aio.accumulator import Accumulator

    mode = cfg["mode"]
    peers: int = cfg["peers"]
    if mode == "convergence":
        from swarmavg.testing import workload

        corpus = workload.load_corpus()
        model = workload.make_model(seed=0)
        params = list(model.parameters())
        buffers = list(model.buffers())
        opt = workload.make_optimizer(params)
        data = workload.batches(
            corpus, cfg["batch"], seed=0, peer=cfg["index"], num_peers=peers, sharded=True
        )
        vbs = peers * cfg["batch"]
    else:
        params = [torch.nn.Parameter(torch.zeros(cfg["size"]))]
        buffers = []
        opt = torch.optim.SGD(params, lr=1e-6)
        vbs = peers
    initial = [cfg["initial"]] if cfg.get("initial") else []
    async with (
        DHT(initial, transport_options={"encryption": cfg.get("encryption", False)}) as dht,
        Accumulator(
            "bench",
            params,
            buffers,
            dht=dht,
            virtual_batch_size=vbs,
            parallel_gradients=cfg.get("parallel", 1),
            refresh_period=0.5,
        ) as acc,
        anyio.create_task_group() as tg,
    ):
        say(event="started", address=str(dht.get_visible_maddrs()[0]))

        async def serve_states() -> None:
            while True:
                await acc.wait_state_request()
                acc.set_state({"optimizer": opt.state_dict()})

        tg.start_soon(serve_states)
        with anyio.fail_after(cfg["form_timeout"]):
            while not (acc.connected() and len(acc.core.members) == peers):  # noqa: ASYNC110
                await anyio.sleep(0.02)
        if acc.has_new_state():
            opt.load_state_dict(acc.state()["optimizer"])  # type: ignore[index]

        allreduce_s: list[float] = []
        if cfg.get("profile"):  # (--profile: time the all-reduce inside each round)
            run = acc.allreduce.run

            async def timed_run(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await run(*a, **k)
                finally:
                    allreduce_s.append(time.perf_counter() - t)

            acc.allreduce.run = timed_run  # type: ignore[method-assign]

        def set_grads() -> None:
            for p in params:
                p.grad = torch.ones_like(p)

        out: dict[str, Any] = {}
        with anyio.fail_after(cfg["run_timeout"]):
            if mode == "latency":
                times, cpus = [], []
                for i in range(cfg["warmup"] + cfg["rounds"]):
                    while not acc.wants_gradients():  # noqa: ASYNC110 (not after a result)
                        await anyio.sleep(0.001)
                    set_grads()
                    t, cpu = time.perf_counter(), time.process_time()
                    await acc.reduce_gradients(1)
                    while not acc.has_gradients():  # (a count to retry after a fault)
                        if acc.wants_gradients():
                            await acc.skip_gradients()
                        else:
                            with anyio.move_on_after(0.05):
                                await acc.wait_gradients()
                    elapsed = time.perf_counter() - t
                    cpu = time.process_time() - cpu
                    acc.zero_gradients()
                    if i >= cfg["warmup"]:
                        times.append(elapsed)
                        cpus.append(cpu)
                out = {"times_s": times, "cpu_s": cpus, "allreduce_s": allreduce_s[cfg["warmup"] :]}
            elif mode == "throughput":
                epochs0 = acc.group.epoch_count
                start = cfg["start_at"]
                await anyio.sleep(max(0.0, start - time.monotonic()))
                end = start + cfg["duration"]
                began = time.monotonic()  # (later than start if the cohort formed late)
                results = contributions = failed = timeouts = 0
                while time.monotonic() < end:
                    if acc.has_gradients():
                        results += 1
                        acc.zero_gradients()
                    elif acc.wants_gradients():
                        set_grads()
                        await acc.reduce_gradients(1, wait=False)
                        contributions += 1
                    else:
                        before = acc.failed_rounds
                        with anyio.move_on_after(0.05) as scope:
                            await acc.wait_gradients()
                        timeouts += scope.cancelled_caught
                        failed += max(0, acc.failed_rounds - before)
                out = {
                    "results": results,
                    "contributions": contributions,
                    "epoch_changes": acc.group.epoch_count - epochs0,
                    "failed_allreduces": failed,
                    "wait_timeouts": timeouts,  # (waits for a result cut at 50 ms)
                    "version": acc.model_version(),
                    "window_s": end - began,
                }
            elif mode == "convergence":
                curve = []
                t0 = time.perf_counter()
                while acc.model_version() < cfg["steps"]:
                    if acc.wants_gradients():
                        x, y = next(data)
                        workload.loss_fn(model, x, y).backward()
                        await acc.reduce_gradients(cfg["batch"])
                    else:
                        with anyio.move_on_after(0.05):
                            await acc.wait_gradients()
                    if acc.has_gradients():
                        opt.step()
                        acc.zero_gradients()
                        v = acc.model_version()
                        if cfg["index"] == 0 and (v % cfg["eval_every"] == 0 or v == cfg["steps"]):
                            curve.append([v, workload.evaluate(model, corpus)])
                out = {"curve": curve, "seconds": time.perf_counter() - t0}
        # let the others finish their last round before this one leaves
        await anyio.sleep(cfg.get("linger", 1.0))
        say(event="result", index=cfg["index"], **out)
        tg.cancel_scope.cancel()


def local(cfg: dict[str, Any]) -> None:
    from swarmavg.testing import workload

    corpus = workload.load_corpus()
    model = workload.make_model(seed=0)
    opt = workload.make_optimizer(model.parameters())
    batch = cfg["peers"] * cfg["batch"]
    curve = []
    t0 = time.perf_counter()
    for step, (x, y) in zip(
        range(1, cfg["steps"] + 1),
        workload.batches(corpus, batch, seed=0, sharded=True),
        strict=False,
    ):
        opt.zero_grad()
        workload.loss_fn(model, x, y).backward()
        opt.step()
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            curve.append([step, workload.evaluate(model, corpus)])
    say(event="result", index=0, curve=curve, seconds=time.perf_counter() - t0)


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = json.loads(sys.argv[1])
    import anyio
    import torch

    torch.set_num_threads(1)
    try:
        if cfg["mode"] == "local":
            local(cfg)
        elif cfg.get("profile"):
            import cProfile

            profiler = cProfile.Profile()
            profiler.runcall(anyio.run, cohort, cfg)
            profiler.dump_stats(f"{cfg['profile']}.{cfg['index']}")
        else:
            anyio.run(cohort, cfg)
    except BaseException as exc:
        say(event="error", error=f"{type(exc).__name__}: {exc}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
