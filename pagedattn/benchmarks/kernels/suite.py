"""One run of `pagedattn bench kernels`: the ceilings, then every case on every provider.

Per case, in this order on one workload (the same pools, tables and queries): our kernels raw,
flashinfer-raw, the registered backends through the contract (those whose cache layout views
the shared pools first, FlashInfer's copy last), then dense SDPA. Each provider's first call
runs eagerly on set 0 with its output poisoned (NaN) beforehand; that output is checked against
the reference, then the provider is timed (timing.py). Results are rewritten to JSON/CSV after
every case, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import pagedattn

from .cases import Case
from .tiles import tile_label
from .ceilings import measure_ceilings
from .contract import prepare_contract
from .environment import environment
from .floors import work
from .peers import SDPA_KINDS, prepare_flashinfer, prepare_sdpa
from .raw import prepare_raw
from .report import make_row, markdown, write_all, write_csv, write_json
from .step import NotApplicable, Step
from .timing import Flusher, rotation_sets, time_back_to_back, time_events, time_graph, time_steps
from .workload import make_workload

RAW, FLASHINFER_RAW = "raw", "flashinfer-raw"
# the reference of rel_l2, best first: FlashInfer called directly, else its backend, the torch
# backend (the contract's definition), dense SDPA
REFERENCES = (FLASHINFER_RAW, "flashinfer", "torch", "sdpa-flash", "sdpa-cudnn")
DEFAULT_L2_BYTES = 50 << 20


@dataclass(frozen=True)
class Provider:
    name: str  # the row's provider: raw, flashinfer-raw, a backend name, sdpa-cudnn, sdpa-flash
    kind: str  # "raw", "peer", "contract" or "dense"
    prepare: Callable  # (workload, graph: bool) -> Step


def providers(selection: list[str] | None, splits: list[int] = (),
              tiles: list[tuple] = ()) -> tuple[list[Provider], list[str]]:
    """The providers to run (flashinfer-raw always: it is the reference of the speed and error
    columns), and one line per registered backend that cannot run here; `splits` adds one
    `raw-s<N>` row per forced split count, `tiles` one `raw-<tile_label>` row per forced tile."""
    statuses = pagedattn.list_backends()
    wanted = set(selection or [])
    if "sdpa" in wanted:
        wanted |= {f"sdpa-{k}" for k in SDPA_KINDS}

    def on(name: str) -> bool:
        return not selection or name in wanted

    out = [Provider(RAW, "raw", lambda w, graph: prepare_raw(w))] if on(RAW) else []
    out += [Provider(f"{RAW}-s{n}", "raw", lambda w, graph, n=n: prepare_raw(w, n)) for n in splits]
    out += [Provider(f"{RAW}-{tile_label(t)}", "raw", lambda w, graph, t=t: prepare_raw(w, tile=t))
            for t in tiles]
    out.append(Provider(FLASHINFER_RAW, "peer", prepare_flashinfer))
    unavailable = [f"{s.name}: {'; '.join(s.reasons)}" for s in statuses if not s.available and on(s.name)]
    names = [s.name for s in statuses if s.available and on(s.name)]
    for name in sorted(names, key=lambda n: (n != "triton", n == "flashinfer")):
        out.append(Provider(name, "contract", lambda w, graph, n=name: prepare_contract(n, w, graph)))
    for k in SDPA_KINDS:
        if on(f"sdpa-{k}"):
            out.append(Provider(f"sdpa-{k}", "dense", lambda w, graph, k=k: prepare_sdpa(k, w)))
    return out, unavailable


def _reason(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:200]


def _time(step: Step, case: Case, flusher: Flusher) -> tuple[float, str]:
    if case.timing == "events" or step.eager_only:
        return time_events(step.calls, flusher)
    timer = time_graph if case.timing == "graph" else time_steps
    try:
        return timer(step.calls)
    except Exception as exc:  # noqa: BLE001 - a step that cannot be captured is timed eagerly, said so
        us, how = time_events(step.calls, flusher)
        return us, f"{how}; graph capture failed ({_reason(exc)})"


def _caller_times(step: Step) -> dict:
    """A mixed step as callers see it: eager calls back to back (host included) and replayed."""
    out = dict(eager_us=round(time_back_to_back(step.calls)[0], 2))
    if not step.eager_only:
        try:
            out["replay_us"] = round(time_steps(step.calls)[0], 2)
        except Exception as exc:  # noqa: BLE001 - not capturable: said in the row
            out["note"] = f"{step.note}; replay failed ({_reason(exc)})"
    return out


def run_provider(p: Provider, w, flusher: Flusher) -> tuple[dict, torch.Tensor | None]:
    """(row fields, set 0's output) of provider `p` on workload `w`."""
    graph = w.case.timing != "events"
    try:
        step = p.prepare(w, graph)
    except NotApplicable as exc:
        return dict(skipped=f"not applicable: {exc}"), None
    except pagedattn.BackendUnavailableError as exc:
        return dict(skipped=f"unavailable: {_reason(exc)}"), None
    except (NotImplementedError, ValueError, TypeError) as exc:
        return dict(skipped=f"refused: {_reason(exc)}"), None
    except Exception as exc:  # noqa: BLE001 - a failure is a result too; the run goes on
        return dict(skipped=f"failed to set up: {_reason(exc)}"), None
    try:
        for s in w.sets:
            s.out.fill_(float("nan"))  # an element the provider never writes shows in rel_l2
        step.calls[0]()
        torch.cuda.synchronize()
        out = step.output().clone()
        us, how = _time(step, w.case, flusher)
        fields = dict(time_us=us, how=how, store=step.store, note=step.note)
        if w.case.grid == "mixed":
            fields.update(_caller_times(step))
        return fields, out
    except Exception as exc:  # noqa: BLE001
        return dict(skipped=f"failed: {_reason(exc)}", store=step.store), None
    finally:
        del step
        gc.collect()
        torch.cuda.empty_cache()


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = out.float(), ref.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_case(case: Case, plist: list[Provider], ceilings: dict, flusher: Flusher, device: torch.device,
             bar: tqdm) -> list[dict]:
    """Rows of every provider on `case`, with speed and error against the reference."""
    wk = work(case)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES
    sets = rotation_sets(wk.bytes, l2) if case.timing != "events" else 1
    w = make_workload(case, device, sets)
    fields, outs = {}, {}
    for p in plist:
        bar.set_postfix_str(f"{case.name[:48]} / {p.name}")
        fields[p.name], out = run_provider(p, w, flusher)
        if out is not None:
            outs[p.name] = out
        bar.update()
    del w
    ref_name = next((n for n in REFERENCES if n in outs), None)
    fi_time = fields.get(FLASHINFER_RAW, {}).get("time_us")
    rows = []
    for p in plist:
        f = dict(fields[p.name])
        if f.get("time_us") and fi_time:
            f["speed_vs_flashinfer"] = round(fi_time / f["time_us"], 3)
        for key in ("eager_us", "replay_us"):
            peer = fields.get(FLASHINFER_RAW, {}).get(key)
            if f.get(key) and peer:
                f[f"{key[:-3]}_speed_vs_flashinfer"] = round(peer / f[key], 3)
        if p.name in outs and ref_name and p.name != ref_name:
            f["rel_l2"] = _rel_l2(outs[p.name], outs[ref_name])
            f["rel_l2_ref"] = ref_name
        rows.append(make_row(case, wk, ceilings, p.name, p.kind, **f))
    outs.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def run_suite(cases: list[Case], selection: list[str] | None, out_dir: Path, argv: list[str],
              splits: list[int] = (), tiles: list[tuple] = ()) -> dict:
    """Measure the ceilings, run every case, write the files under `out_dir`; returns the report."""
    device = torch.device("cuda")
    plist, unavailable = providers(selection, splits, tiles)
    report = dict(environment=environment(device), arguments=argv, unavailable=unavailable,
                  providers=[p.name for p in plist], rows=[])
    out_dir.mkdir(parents=True, exist_ok=True)
    with tqdm(total=1 + len(cases) * len(plist), unit="row", dynamic_ncols=True, mininterval=2.0) as bar:
        bar.set_postfix_str("ceilings")
        report["ceilings"] = ceilings = measure_ceilings(device)
        bar.update()
        flusher = Flusher(device, ceilings["copy_gbs"])
        for case in cases:
            report["rows"] += run_case(case, plist, ceilings, flusher, device, bar)
            write_json(out_dir / "results.json", report)
            write_csv(out_dir / "results.csv", report)
    write_all(out_dir, report)
    print(markdown(report))
    return report
