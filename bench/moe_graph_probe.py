"""Where the mixture-of-experts training step with CUDA graphs faults (an illegal memory access on
an H200, Qwen3-30B-A3B's layer at 2,048 tokens), case by case, each case in a process of its own.

The one-layer model of bench/moe_layer_profile.py (``build``: the real layer's shape, NF4 experts, a
1,024-id vocabulary, LoRA r16 on the attention and, in the ``experts`` variant, on the experts) runs
``FastModel.loss(ids, ids).backward()`` step after step, as that script's ``layer_step`` does, under
one case's settings. After the forward, after the backward and after the capture (torch's
``make_graphed_callables``, wrapped here) the process waits for the GPU and logs where it is, to a
JSON file it rewrites each time and to stdout: a fault is pinned to the capture, to the Nth replay's
forward or backward, or to the eager loss in between. Each step records its loss, the adapters'
gradient norm (``.grad`` cleared before the step: one step's) and the token copies the experts took;
the parent compares them with the ``eager`` case's at the same token count.

Cases (``--cases``, in this order; each changes one thing, or three, against ``graphs``):

- ``graphs``: the defaults (``FastPathConfig()``), what faults.
- ``eager``: no graphs (the reference the others are compared with), at 2,048 and 256 tokens.
- ``no_offload``: ``host_offload=False``: torch's checkpointing instead of engine/fast/offload.py's
  OffloadedLayer (the graphed block, which does not fault, is checkpointed too).
- ``pre_quick_wins``: the next three together: the MoE block as it ran at 0e07c63, the last commit
  whose graphed layer step ran clean on the H200 (bench/results/current/
  h200_moe_layer_diag_qwen3_0e07c63.json), but for the one-byte sort.
- ``no_kept_routing``: KeptRouting.keep does nothing, so the recomputation routes and sorts again
  instead of taking the forward's routing (monkeypatched: no engine switch).
- ``recompute_reads``: the MoE block is always called with ``read=True``, so the recomputation
  runs down's product and the combine instead of the zero that owns no memory (monkeypatched).
- ``no_moe_kernels``: torch's operations for the experts' activation and the copies' sums
  (expert_activation.py's and expert_copies.py's ``available`` say no; monkeypatched), Studio's
  other kernels on.
- ``no_kernels``: ``kernels=False``: torch's operations instead of every Studio Triton kernel
  (garbage indices would then stop at index_add_'s device assert instead of an illegal access).
- ``tokens_256``: 256 tokens.
- ``launch_blocking``: the defaults with ``CUDA_LAUNCH_BLOCKING=1`` (does the capture still happen?
  ``captured`` and ``graphs_failed`` say).
- ``keep_cublas_workspaces``: engine/fast/graphs.py's clearing of cuBLAS's workspace map after the
  capture left out (monkeypatched).
- ``experts``: the defaults, LoRA on the experts too.

The JSON (``--out``) holds each case's outcome: ``ok`` or how its process ended, the steps done, the
last phase reached, the error's text and the end of stderr, whether a graph was captured, and the
losses and gradient norms beside the eager case's. ``--budget-s``: no case starts after it; a case
is killed after ``--case-timeout-s``. ``--jobs``: cases run this many at once (separate processes
on one GPU: a fault in one leaves the others' CUDA contexts alone). ``--tiny`` runs on the CPU
(each family's tiny shape, fp32; no graphs there: the plumbing only).

    # the GPU box, from the repository root (about three minutes)
    python3 bench/moe_graph_probe.py --budget-s 170 --jobs 3 --commit <sha> --out $OUT/moe_graph_probe.json
    # here, on the CPU
    python3 bench/moe_graph_probe.py --tiny --tokens 64 --steps 2 --out /tmp/moe_graph_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.isolated import TAIL_CHARS, _ended, is_cuda_error  # noqa: E402

CASES: dict[str, dict] = {
    "graphs": {},
    "eager": {"graphs": False, "tokens": "both"},
    "no_offload": {"host_offload": False},
    "pre_quick_wins": {"patch": ("no_kept_routing", "recompute_reads", "no_moe_kernels")},
    "no_kept_routing": {"patch": ("no_kept_routing",)},
    "recompute_reads": {"patch": ("recompute_reads",)},
    "no_moe_kernels": {"patch": ("no_moe_kernels",)},
    "no_kernels": {"kernels": False},
    "tokens_256": {"tokens": "small"},
    "launch_blocking": {"env": {"CUDA_LAUNCH_BLOCKING": "1"}},
    "keep_cublas_workspaces": {"patch": ("keep_cublas_workspaces",)},
    "experts": {"variant": "experts"},
}
"""Each case's difference from ``graphs`` (the defaults): graphs, host offload and kernels
(FastPathConfig's), the tokens (``--tokens``, ``--small-tokens`` or both), the LoRA variant, an
environment and a monkeypatch (:func:`patch`)."""
SMALL_TOKENS = 256


# ------------------------------------------------------------------------------------- the child


class Log:
    """The child's progress, rewritten whole at each change (the parent reads it after a crash)."""

    def __init__(self, path: Path, case: str):
        self.path = path
        self.state: dict = {"case": case, "phase": "starting", "steps": [], "captured": False}
        self.write()

    def write(self) -> None:
        part = self.path.with_suffix(".part")
        part.write_text(json.dumps(self.state))
        part.replace(self.path)

    def phase(self, text: str) -> None:
        self.state["phase"] = text
        self.write()
        print(f"[{self.state['case']}] {text}", flush=True)


def patch(names: tuple[str, ...], log: Log) -> None:
    """A case's monkeypatches of the engine (bench only: studio/ keeps no hidden switch)."""
    for name in names:
        _patch(name)
    log.state["patch"] = list(names)


def _patch(name: str) -> None:
    import torch

    from studio.engine.fast import expert_activation, expert_copies, moe, routing

    if name == "no_kept_routing":
        routing.KeptRouting.keep = lambda self, keys, order, offs: None
    elif name == "recompute_reads":
        original = moe.SparseMlp.__call__

        def reading(self, x, gate_up_adapters, down_adapters, kept=None, read=True):
            return original(self, x, gate_up_adapters, down_adapters, kept, True)

        moe.SparseMlp.__call__ = reading
    elif name == "no_moe_kernels":
        expert_activation.available = expert_copies.available = lambda device, dtype: False
    elif name == "keep_cublas_workspaces":
        torch._C._cuda_clearCublasWorkspaces = lambda: None
    else:
        raise SystemExit(f"unknown patch {name}")


def count_sorts(log: Log) -> None:
    """Count the sparse layers' sorts by expert in ``log`` (a recomputation that takes the forward's
    routing sorts nothing; in a graphed step only the warm-up and the capture run Python)."""
    from studio.engine.fast import moe

    original = moe.SparseMlp.sort
    log.state["sorts"] = 0

    def counted(self, chosen):
        log.state["sorts"] += 1
        return original(self, chosen)

    moe.SparseMlp.sort = counted


def watch_capture(log: Log, cuda: bool) -> None:
    """Log the capture's start and end (the GPU waited for after it), around torch's
    ``make_graphed_callables`` as engine/fast/graphs.py calls it."""
    import torch

    original = torch.cuda.make_graphed_callables

    def logged(*args, **kwargs):
        log.phase("capturing")
        out = original(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        log.state["captured"] = True
        log.phase("captured")
        return out

    torch.cuda.make_graphed_callables = logged


def run_case(args, spec: dict, log: Log) -> None:
    """The case's steps, each forward and backward waited for and logged."""
    import torch

    from bench.moe_layer_profile import VOCAB, build, storage_for
    from studio.core.config import FastPathConfig
    from studio.engine import fast

    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    log.state["launch_blocking"] = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
    log.state["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    patch(spec.get("patch", ()), log)
    count_sorts(log)
    watch_capture(log, cuda)
    log.phase("building")
    model = build(args.model, args.tiny, storage_for(args.model, "auto"), spec.get("variant", "attn") == "experts",
                  args.rank, device, dtype)
    options = FastPathConfig(cuda_graphs=spec.get("graphs", True), host_offload=spec.get("host_offload", True),
                             kernels=spec.get("kernels", True))
    fm, why = fast.prepare(model, options)
    if fm is None:
        raise RuntimeError(f"the fast path refused the model: {why}")
    params = [p for p in model.parameters() if p.requires_grad]
    tokens = spec.get("tokens", "large")
    counts = {"large": [args.tokens], "small": [args.small_tokens], "both": [args.tokens, args.small_tokens]}[tokens]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for n in counts:
        ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(2)).to(device)
        for step in range(args.steps):
            where = f"{n} tokens, step {step + 1}"
            for p in params:
                p.grad = None
            log.phase(f"{where}: forward")
            loss = fm.loss(ids, ids)
            sync()
            log.phase(f"{where}: loss {loss.item():.6f}; backward")
            loss.backward()
            sync()
            grads = [p.grad.float().norm() for p in params if p.grad is not None]
            record = {"tokens": n, "step": step + 1, "loss": loss.item(),
                      "grad_norm": torch.stack(grads).norm().item() if grads else 0.0,
                      "expert_tokens": sum(fm.take_expert_tokens()), "graphs_failed": fm.graphs_failed,
                      "graphed": bool(fm._graphs is not None and fm._graphs.graphed)}
            log.state["steps"].append(record)
            log.phase(f"{where}: done (grad norm {record['grad_norm']:.6g})")
            if args.abort_at_step and len(log.state["steps"]) == args.abort_at_step:
                os.abort()  # the probe's own test: a process that dies mid-case
        fm.release_graphs()
    log.phase("finished")


def child(args) -> int:
    log = Log(Path(args.out), args.case)
    try:
        run_case(args, CASES[args.case], log)
    except Exception as exc:  # noqa: BLE001 - the case's outcome, read by the parent
        log.state["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        log.state["traceback"] = traceback.format_exc()[-3000:]
        log.state["cuda_error"] = is_cuda_error(exc)
        log.write()
    # No interpreter teardown: after a CUDA error, freeing the tensors still alive aborts the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------ the parent


def child_argv(args, case: str, log: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--model", args.model, "--tokens",
            str(args.tokens), "--small-tokens", str(args.small_tokens), "--steps", str(args.steps), "--rank",
            str(args.rank), "--out", str(log)]
    return argv + (["--tiny"] if args.tiny else []) + (
        ["--abort-at-step", str(args.abort_at_step)] if args.abort_at_step and case == args.abort_case else [])


class Running:
    """One case's child process, its log and its stderr."""

    def __init__(self, args, case: str, folder: Path):
        self.case = case
        self.log = folder / f"{case}.json"
        self.err_path = folder / f"{case}.stderr"
        env = dict(os.environ, **CASES[case].get("env", {}))
        self.err = self.err_path.open("w")
        self.started = time.time()
        self.proc = subprocess.Popen(child_argv(args, case, self.log), env=env, stderr=self.err)

    def outcome(self, rc: int | None, timeout_s: float) -> dict:
        self.err.close()
        stderr = self.err_path.read_text(errors="replace")
        try:
            state = json.loads(self.log.read_text())
        except (OSError, ValueError):
            state = {"phase": "never started", "steps": [], "captured": False}
        state["wall_s"] = round(time.time() - self.started, 1)
        state["steps_done"] = len(state["steps"])
        clean = rc == 0 and state.get("phase") == "finished" and "error" not in state
        state["outcome"] = "ok" if clean else (
            f"error at '{state.get('phase')}'" if rc == 0 else f"the process {_ended(rc, timeout_s)} at "
                                                               f"'{state.get('phase')}'")
        if not clean:
            state["stderr_tail"] = stderr[-TAIL_CHARS:]
        return state


def compare(results: dict[str, dict]) -> None:
    """Each case's losses and gradient norms against the ``eager`` case's at the same token count."""
    reference = {s["tokens"]: s for s in results.get("eager", {}).get("steps", [])}
    for case, result in results.items():
        if case == "eager":
            continue
        rows = []
        for s in result.get("steps", []):
            ref = reference.get(s["tokens"])
            if ref is None:
                continue
            rows.append({"step": s["step"], "loss_diff": abs(s["loss"] - ref["loss"]),
                         "grad_norm_rel_diff": abs(s["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30),
                         "expert_tokens_equal": s["expert_tokens"] == ref["expert_tokens"]})
        if rows:
            result["against_eager"] = rows


def parent(args) -> int:
    import tempfile

    start = time.time()
    deadline = start + args.budget_s
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    from bench.families import _commit, _versions

    report: dict = {"what": "the MoE training step with CUDA graphs, case by case (bench/moe_graph_probe.py)",
                    "command": " ".join(sys.argv), "commit": _commit(args.commit), "versions": _versions(),
                    "model": args.model, "tiny": args.tiny, "tokens": args.tokens, "small_tokens": args.small_tokens,
                    "steps": args.steps, "jobs": args.jobs, "cases": {}}

    def write() -> None:
        compare(report["cases"])
        report["wall_s"] = round(time.time() - start, 1)
        out_path.write_text(json.dumps(report, indent=1) + "\n")

    pending = list(args.case_list)
    running: list[Running] = []
    with tempfile.TemporaryDirectory(prefix="moe-graph-probe-") as folder:
        while pending or running:
            while pending and len(running) < args.jobs:
                case = pending.pop(0)
                if time.time() > deadline:
                    report["cases"][case] = {"outcome": "skipped: --budget-s spent", "steps": []}
                    write()
                    continue
                print(f"case {case}: {json.dumps(CASES[case])}", flush=True)
                running.append(Running(args, case, Path(folder)))
            time.sleep(0.5)
            for item in list(running):
                rc = item.proc.poll()
                late = time.time() - item.started > args.case_timeout_s
                if rc is None and not late:
                    continue
                if rc is None:
                    item.proc.kill()
                    item.proc.wait()
                running.remove(item)
                report["cases"][item.case] = item.outcome(rc, args.case_timeout_s)
                print(f"case {item.case}: {report['cases'][item.case]['outcome']} "
                      f"({report['cases'][item.case]['steps_done']} steps)", flush=True)
                write()
    write()
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--cases", default=",".join(CASES), help=f"a comma list of {', '.join(CASES)}")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--small-tokens", type=int, default=SMALL_TOKENS, help="the tokens_256 case's tokens")
    parser.add_argument("--steps", type=int, default=5, help="steps a case runs (the first one captures)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once")
    parser.add_argument("--budget-s", type=float, default=170.0, help="no case starts after this")
    parser.add_argument("--case-timeout-s", type=float, default=150.0, help="a case's process is killed after this")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU (fp32, no graphs)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--abort-at-step", type=int, default=0,
                        help="(the probe's test) --abort-case's process aborts after this many steps")
    parser.add_argument("--abort-case", default="", help=argparse.SUPPRESS)
    parser.add_argument("--case", default="", help=argparse.SUPPRESS)  # a child: this case alone
    args = parser.parse_args(argv)
    from bench.moe_shapes import MOE_MODELS

    args.case_list = [c for c in args.cases.split(",") if c]
    problems = [f"--cases {c}: not one of {', '.join(CASES)}" for c in args.case_list if c not in CASES]
    if args.model not in MOE_MODELS:
        problems.append(f"--model {args.model}: not one of {', '.join(MOE_MODELS)}")
    if args.case and args.case not in CASES:
        problems.append(f"--case {args.case}: not one of {', '.join(CASES)}")
    if problems:
        raise SystemExit("\n".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return child(args) if args.case else parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
