"""What a decode step runs, op by op (issue 55): `torch.profiler` around a few steps of a running batch.

`step_profile` splits a step's wall time into the engine's stages; this says what fills them: the ops by
time, and what keeps a GPU from its floor, counted per step:

- ``launches`` and ``kernels``: kernel launches the host made and kernels the device ran (CUDA only);
- ``device_busy_ms`` / ``device_idle_ms``: within the step, the device's time in kernels and copies, and the
  rest (CUDA only): a step far above its weights' read time with the device idle is bound by the host;
- ``host_gap_ms``: the step's host time inside no op (Python: the engine's bookkeeping, transformers' modules),
  with the longest gaps and the ops around them;
- ``copies`` (``aten::copy_``, what ``.to()`` and indexed writes run), ``host_tensors`` (tensors built from
  Python data, ``torch.tensor(...)``: each an upload on a GPU), ``h2d`` / ``d2h`` / ``d2d`` (the device's memcpys,
  CUDA only);
- ``syncs``: what makes the host wait for the device: ``.item()``/``int()`` of a tensor (its
  ``_local_scalar_dense``), ``nonzero``, stream and device synchronisations (counted on the CPU too, where
  they cost nothing, so the CPU's report names what would wait on a GPU);
- ``sites``: where in milo's code (or transformers') the syncs, host tensors and copies come from (one more step,
  profiled with Python's stacks).

Counts the CUDA-only entries as None on the CPU: the report has one shape everywhere. The profiler's own
overhead inflates the host's share; read the counts and the ranking, not the milliseconds.
"""
from __future__ import annotations

import collections

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP = "milo.decode_step"
SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize", "cudaDeviceSynchronize",
         "cudaEventSynchronize"}
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}
MEMCPY = {"h2d": "HtoD", "d2h": "DtoH", "d2d": "DtoD"}
SITE_ROOTS = ("milo_infer/", "milo_kernels/", "transformers/")


def profile_decode(batch, steps: int, *, warmup: int = 1, top: int = 15) -> dict:
    """``warmup`` unprofiled steps of ``batch`` (a running batch: `step_profile.decoding_batch`), ``steps``
    profiled ones, then one more with Python's stacks (which slow the host too much to time it) for the sites:
    the report the module's docstring describes, every count per step."""
    for _ in range(warmup):
        batch.step()
    cuda = batch.engine.device.type == "cuda"
    report = summarise(profiled_steps(batch, steps, cuda, stacks=False), steps, cuda, top)
    traced = profiled_steps(batch, 1, cuda, stacks=True)
    spans = step_spans(traced)
    traced = [e for e in traced if inside(e, spans)]
    report["sites"] = {kind: dict(collections.Counter(site(e) for e in traced if pick(e)).most_common(8))
                       for kind, pick in (("syncs", lambda e: e.name in SYNCS),
                                          ("host_tensors", lambda e: e.name == "aten::lift_fresh"),
                                          ("copies", lambda e: e.name == "aten::copy_"))}
    return {"rows": len(batch.rows), "device": str(batch.engine.device), "attention": batch.engine.attention,
            **report}


def profiled_steps(batch, steps: int, cuda: bool, stacks: bool) -> list:
    """The profiler's events of ``steps`` steps of ``batch``, each under a `STEP` range."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=stacks) as prof:
        for _ in range(steps):
            with record_function(STEP):
                batch.step()
            if cuda:
                torch.cuda.synchronize(batch.engine.device)
    return list(prof.events())


def summarise(events, steps: int, cuda: bool, top: int = 15) -> dict:
    """The report of ``steps`` profiled steps from the profiler's ``events`` (each step under a `STEP` range)."""
    marks = sorted((e for e in events if e.name == STEP and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    if len(marks) != steps:
        raise RuntimeError(f"the profile holds {len(marks)} steps, {steps} were run")
    thread = marks[0].thread
    spans = step_spans(events)  # not the synchronisation between steps, nor the profiler's own start and stop
    host = [e for e in events if e.device_type == DeviceType.CPU and e.name != STEP and not e.is_python_function
            and inside(e, spans)]
    device = [e for e in events if e.device_type != DeviceType.CPU and inside(e, spans)]
    per = 1.0 / steps
    step_us = sum(m.time_range.end - m.time_range.start for m in marks)
    names = collections.Counter(e.name for e in host)

    def count(keys) -> float:
        return sum(names[k] for k in keys) * per

    ops = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])  # name -> host calls, self host us, device us, runs
    for e in host:
        op = ops[e.name]
        op[0] += 1
        op[1] += e.self_cpu_time_total
    for e in device:
        op = ops[e.name]
        op[2] += e.time_range.end - e.time_range.start
        op[3] += 1
    ranked = sorted(ops.items(), key=lambda kv: -(kv[1][2] if cuda else kv[1][1]))
    gaps, gap_us = host_gaps(marks, [e for e in host if e.thread == thread])
    busy_us = union_us([(e.time_range.start, e.time_range.end) for e in device]) if cuda else None
    return {
        "steps": steps, "step_ms": step_us * per / 1e3,
        "ops": [{"name": name, "calls": (calls or runs) * per, "host_ms": host_us * per / 1e3,
                 "device_ms": device_us * per / 1e3 if cuda else None}  # a kernel's calls: its runs
                for name, (calls, host_us, device_us, runs) in ranked[:top]],
        "host_ms_in_ops": (step_us - gap_us) * per / 1e3, "host_gap_ms": gap_us * per / 1e3,
        "longest_host_gaps": gaps[:5],
        "launches": count(LAUNCHES) if cuda else None,
        "kernels": sum(not is_memcpy(e) for e in device) * per if cuda else None,
        "device_busy_ms": busy_us * per / 1e3 if cuda else None,
        "device_idle_ms": (step_us - busy_us) * per / 1e3 if cuda else None,
        "copies": names["aten::copy_"] * per, "host_tensors": names["aten::lift_fresh"] * per,
        **{kind: sum(direction in e.name for e in device if is_memcpy(e)) * per if cuda else None
           for kind, direction in MEMCPY.items()},
        "syncs": count(SYNCS), "syncs_by_op": {k: names[k] * per for k in sorted(SYNCS) if names[k]},
    }


def step_spans(events) -> list[tuple[float, float]]:
    return [(e.time_range.start, e.time_range.end) for e in events
            if e.name == STEP and e.device_type == DeviceType.CPU]


def inside(event, spans) -> bool:
    """Whether ``event`` started within a step (a kernel runs after its launch, but before the step's logits
    reach the host, which the step waits for)."""
    return any(lo <= event.time_range.start <= hi for lo, hi in spans)


def is_memcpy(event) -> bool:
    return "Memcpy" in event.name or "memcpy" in event.name


def site(event) -> str:
    """The innermost frame of milo's (or transformers') code that ``event`` ran under (a profile with stacks)."""
    frame = event.cpu_parent
    while frame is not None:
        for root in SITE_ROOTS:
            if root in frame.name:
                return root + frame.name.split(root, 1)[1]
        frame = frame.cpu_parent
    return "?"


def union_us(intervals) -> float:
    """Microseconds covered by the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def host_gaps(marks, ops) -> tuple[list[dict], float]:
    """The host's time inside each step but inside no op (ops nest: only the outermost count), in all, and the
    longest gaps with the ops before and after them."""
    gaps, total = [], 0.0
    for mark in marks:
        lo, hi = mark.time_range.start, mark.time_range.end
        inside = sorted((e for e in ops if lo <= e.time_range.start and e.time_range.end <= hi),
                        key=lambda e: e.time_range.start)
        reach, before = lo, "step start"
        for e in inside:
            if e.time_range.start > reach:
                gaps.append({"ms": (e.time_range.start - reach) / 1e3, "after": before, "before": e.name})
                total += e.time_range.start - reach
            if e.time_range.end > reach:
                reach, before = e.time_range.end, e.name
        if hi > reach:
            gaps.append({"ms": (hi - reach) / 1e3, "after": before, "before": "step end"})
            total += hi - reach
    return sorted(gaps, key=lambda g: -g["ms"]), total


def format_report(report: dict) -> str:
    """The report as text: the counts per step, then the ops by time, the longest host gaps and the sites."""
    def num(x, digits=1):
        return "n/a (CUDA only)" if x is None else f"{x:.{digits}f}"

    lines = [f"decode step, {report['rows']} rows on {report['device']} ({report['attention']} attention), "
             f"{report['steps']} steps profiled: {report['step_ms']:.2f} ms a step (profiler on)",
             f"  host: {report['host_ms_in_ops']:.2f} ms in ops, {report['host_gap_ms']:.2f} ms between them",
             f"  device: busy {num(report['device_busy_ms'], 2)} ms, idle {num(report['device_idle_ms'], 2)} ms; "
             f"launches {num(report['launches'])}, kernels {num(report['kernels'])}",
             f"  copies {report['copies']:.1f} (H2D {num(report['h2d'])}, D2H {num(report['d2h'])}, "
             f"D2D {num(report['d2d'])}), host tensors built {report['host_tensors']:.1f}, "
             f"syncs {report['syncs']:.1f} {report['syncs_by_op']}",
             "  ops by " + ("device" if report["device_busy_ms"] is not None else "host") + " time (per step):"]
    for op in report["ops"]:
        lines.append(f"    {op['host_ms']:8.3f} ms host  {num(op['device_ms'], 3):>8} ms device  "
                     f"{op['calls']:7.1f} calls  {op['name']}")
    lines.append("  longest host gaps:")
    lines += [f"    {g['ms']:.3f} ms after {g['after']}, before {g['before']}" for g in report["longest_host_gaps"]]
    for kind, sites in report["sites"].items():
        lines.append(f"  {kind} from (one step):")
        lines += [f"    {n:4d}  {where}" for where, n in sites.items()]
    return "\n".join(lines)
