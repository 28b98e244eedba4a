"""The runner's tables of what each row sent (result.json's collective_bytes, instruments/traffic.py):
the bytes per optimizer step by kind against the formula, and the step time they project to on more
GPUs (a model, labelled as one). It measures only this machine's all-reduce (microbenchmarks/allreduce.py),
which the projection's check at 2 and 3 processes needs: the rows have measured the rest."""
import json
import subprocess
import sys
from pathlib import Path

from instruments import traffic

ROOT = Path(__file__).resolve().parents[1]

SENT_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "broadcast")
BYTES_COLUMNS = ["row", "processes", "micro-batches", *(f"{kind} MB (calls)" for kind in SENT_KINDS), "other MB",
                 "ring MB in+out per process", "formula's ring MB", "measured / formula"]
BYTES_LEGEND = ("Per process (rank 0) and optimizer step, over the steps recorded after the first: the payload of "
                "each kind of collective, the whole buffer it works on (an all-reduce's tensor, an all-gather's "
                "gathered output, a reduce-scatter's input), and the calls. A ring moves 2(n-1)/n of an "
                "all-reduce's payload in and out of each of n processes, (n-1)/n of an all-gather's or a "
                "reduce-scatter's, a broadcast's whole. The formula: the ZeRO paper's volumes with each library's "
                "rules for accumulation (docs/anatomy.md). Measured from what ran: torch.profiler's records of "
                "torch.distributed's operators; Horovod's from its optimizer's calls.")


def megabytes(size):
    return f"{size / 2**20:.2f}"


def bytes_cells(row, label):
    """The row's cells; `label`: report.row_label."""
    measured, allowed = row["collective_bytes"], row.get("collective_formula_bytes")
    head = [label(row), str(row["processes"]), str(row.get("gradient_accumulation", 1))]
    if measured["payload_bytes"] is None:
        return head + [""] * (len(BYTES_COLUMNS) - 4) + [f"not measured: {measured['note']}"]
    kinds = measured["kinds"]
    cells = [f"{megabytes(kinds[kind]['bytes'])} ({kinds[kind]['calls']:g})" if kind in kinds else "-"
             for kind in SENT_KINDS]
    other = sum(totals["bytes"] for kind, totals in kinds.items() if kind not in SENT_KINDS)
    ratio = f"{measured['ring_bytes'] / allowed['ring_bytes']:.3f}" if allowed and allowed["ring_bytes"] else "n/a"
    return head + cells + [megabytes(other), megabytes(measured["ring_bytes"]),
                           megabytes(allowed["ring_bytes"]) if allowed else "n/a", ratio]


# ----------------------------------------------------------------------------- the projection (a model)

# Interconnects named with their published bandwidth per GPU and direction, in GB/s (1e9 bytes), as the
# bus bandwidth a ring reaches at best; no latency. (GPUs, name, GB/s.)
PUBLISHED_LINKS = (
    (8, "NVLink", "NVLink 4 within a node (H100 SXM: 900 GB/s both ways, 450 each way per GPU)", 450.0),
    (64, "InfiniBand", "InfiniBand NDR between 8 nodes (a 400 Gb/s port per GPU: 50 GB/s)", 50.0),
    (64, "Ethernet", "Ethernet between 8 nodes (one 100 Gb/s port per 8-GPU node: 12.5 GB/s shared by 8)", 12.5 / 8),
)
PROJECTION_COLUMNS = ["row", "compute ms", *(f"{gpus} GPUs, {short}: step ms serial / overlapped (efficiency)"
                                             for gpus, short, _, _ in PUBLISHED_LINKS)]
PROJECTION_TITLE = ("Projection (a model, not a measurement) of each row's step at 8 and 64 GPUs, from its measured "
                    "bytes per step, its own compute time and a published bandwidth: "
                    + "; ".join(description for _, _, description, _ in PUBLISHED_LINKS))
CHECK_COLUMNS = ["row", "processes", "compute ms", "communication ms (model)", "predicted step ms serial",
                 "overlapped", "measured step ms", "error serial", "error overlapped"]


def ring_bytes(measured, processes):
    """What a ring moves in and out of each of `processes` for the payloads measured per step."""
    return sum(traffic.ring_bytes(kind, totals["bytes"], processes) for kind, totals in measured["kinds"].items())


def communication_seconds(measured, processes, bus_gbps, latency_seconds=0.0):
    """The model: each call's latency, and the ring's bytes at the link's bus bandwidth."""
    calls = sum(totals["calls"] for totals in measured["kinds"].values())
    return calls * latency_seconds + ring_bytes(measured, processes) / (bus_gbps * 1e9)


def step_seconds(compute, communication):
    """Serial (no overlap) and overlapped (communication hidden under compute where it fits)."""
    return compute + communication, max(compute, communication)


def compute_seconds(row):
    """The row's step without its communication: the steady step less the exposed communication that
    --profile measured, else the whole steady step (its exposed communication included)."""
    step = row["steady_step_seconds"]
    if row.get("profile"):
        return max(step - row["profile"]["phases_ms"]["exposed communication"] / 1000, 0.0)
    return step


def projectable(row):
    return (row["status"] == "ok" and row.get("steady_step_seconds") and row.get("collective_bytes")
            and row["collective_bytes"]["payload_bytes"] is not None)


def project(report):
    """Each row's projection (row["projection"]): its step at 8 and 64 GPUs over PUBLISHED_LINKS, serial and
    overlapped, with the scaling efficiency (the compute's share of the step: each GPU keeps the row's
    work, weak scaling); and where the row ran on several processes here, the same model's prediction of
    its profiled step from its compute and this machine's measured all-reduce."""
    for row in report["rows"]:
        if not projectable(row):
            continue
        compute = compute_seconds(row)
        published = []
        for gpus, _, link, bus_gbps in PUBLISHED_LINKS:
            serial, overlapped = step_seconds(compute, communication_seconds(row["collective_bytes"], gpus, bus_gbps))
            published.append({"gpus": gpus, "link": link, "bus_gbps": bus_gbps, "serial_s": serial,
                              "overlapped_s": overlapped, "efficiency_serial": compute / serial if serial else None,
                              "efficiency_overlapped": compute / overlapped if overlapped else None})
        row["projection"] = {"compute_s": compute, "published": published, "here": predicted_here(row, report)}


def predicted_here(row, report):
    """The model's step for a row profiled here at 2 or more processes, beside the measured one: its
    compute (the recorded steps less their exposed communication) and its bytes at this machine's
    all-reduce."""
    link = (report.get("interconnect") or {}).get(str(row["processes"]), {})
    if row["processes"] < 2 or "busbw" not in link or not row.get("profile"):
        return None
    measured = row["profile"]["step_ms"] / 1000
    compute = measured - row["profile"]["phases_ms"]["exposed communication"] / 1000
    communication = communication_seconds(row["collective_bytes"], row["processes"], link["busbw"], link["latency_s"])
    serial, overlapped = step_seconds(compute, communication)
    return {"compute_s": compute, "communication_s": communication, "serial_s": serial, "overlapped_s": overlapped,
            "measured_s": measured, "error_serial": serial / measured - 1,
            "error_overlapped": overlapped / measured - 1}


def projection_cells(row, label):
    projection = row["projection"]
    cells = [label(row), f"{projection['compute_s'] * 1000:.1f}"]
    for link in projection["published"]:
        efficiency = "/".join(f"{link[key]:.0%}" if link[key] is not None else "n/a"
                              for key in ("efficiency_serial", "efficiency_overlapped"))
        cells.append(f"{link['serial_s'] * 1000:.1f} / {link['overlapped_s'] * 1000:.1f} ({efficiency})")
    return cells


def check_cells(row, label):
    here = row["projection"]["here"]
    return [label(row), str(row["processes"]), f"{here['compute_s'] * 1000:.1f}",
            f"{here['communication_s'] * 1000:.1f}", f"{here['serial_s'] * 1000:.1f}",
            f"{here['overlapped_s'] * 1000:.1f}", f"{here['measured_s'] * 1000:.1f}",
            f"{here['error_serial']:+.0%}", f"{here['error_overlapped']:+.0%}"]


def check_title(report):
    links = report.get("interconnect") or {}
    measured = ", ".join(f"{count} processes {link['busbw']:.2f} GB/s, {link['latency_s'] * 1000:.2f} ms a call"
                         for count, link in links.items() if "busbw" in link)
    return ("The model against this machine (its all-reduce, microbenchmarks/allreduce.py: "
            f"{measured or 'not measured'})")


PROJECTION_LEGEND = ("compute ms: the row's steady step less its exposed communication (--profile), else the whole "
                     "steady step. Each GPU keeps the row's work (weak scaling) and sends "
                     "its measured payloads; a ring moves 2(n-1)/n of an all-reduce's, (n-1)/n of a gather's or "
                     "a reduce-scatter's, at the link's bus bandwidth (no latency, no hierarchy). Serial: compute "
                     "then communication; overlapped: the longer of the two. Efficiency: compute / step. "
                     "docs/anatomy.md says how to read it.")
CHECK_LEGEND = ("The same model for the rows profiled here: their compute (the recorded steps less their exposed "
                "communication) and their communication from the calls' latency and the ring's bytes at this "
                "machine's measured bus bandwidth, against their mean recorded step. error: predicted / measured - 1.")


def sections(report, label):
    """The tables of bytes sent and of the projection, as bench/report.sections has them; `label`: report.row_label."""
    sent = [row for row in report["rows"] if row["status"] == "ok" and row.get("collective_bytes")]
    projected = [row for row in report["rows"] if row.get("projection")]
    checked = [row for row in projected if row["projection"]["here"]]
    return [("Bytes sent per step", BYTES_COLUMNS, [bytes_cells(row, label) for row in sent], [],
             BYTES_LEGEND),
            (PROJECTION_TITLE, PROJECTION_COLUMNS, [projection_cells(row, label) for row in projected], [],
             PROJECTION_LEGEND),
            (check_title(report), CHECK_COLUMNS, [check_cells(row, label) for row in checked], [], CHECK_LEGEND)]


def measure_interconnect(report, max_samples, output_dir):
    """This machine's all-reduce at each process count the profiled rows sent bytes at
    (microbenchmarks/allreduce.py, on the rows' device): a small call's time as the latency, and the
    bus bandwidth of the largest.
    {str(processes): {"latency_s", "busbw"} or {"error"}}; none on several nodes (Slurm's own launch), and
    none without --profile, whose compute the check needs (a launch saved)."""
    counts = sorted({row["processes"] for row in report["rows"]
                     if projectable(row) and row["processes"] > 1 and row.get("profile")})
    if report.get("nnodes") or not counts:
        return {}
    links = {}
    for count in counts:
        path = output_dir / f"allreduce-{count}.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(count),
                   str(ROOT / "microbenchmarks" / "allreduce.py"), "--device", "cpu" if not report["machine"]["gpus"]
                   else "auto", "--model", str(report["model"]), "--sizes", "4K,16M",
                   "--iters", "10", "--warmup", "3", "--json", str(path)]
        command += ["--max-samples", str(max_samples)] if max_samples else []
        process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if process.returncode != 0 or not path.is_file():
            lines = (process.stderr or process.stdout).strip().splitlines()
            links[str(count)] = {"error": lines[-1] if lines else f"exit status {process.returncode}"}
            continue
        rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
        links[str(count)] = {"latency_s": min(r["time_ms"] for r in rows) / 1000,
                             "busbw": max(r["busbw"] for r in rows), "source": "microbenchmarks/allreduce.py"}
    return links
