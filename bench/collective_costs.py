"""Each collective's cost per byte sent (megatron/accounting/measure/comm_counter.py's bytes: the ZeRO paper's volume), relative to
the all-reduce's and, given the link's bandwidth, to bytes / bandwidth: the cost factors of
megatron/accounting/predict/step_time.py's COST_FACTORS, measured on the ranks this runs on.

megatron/accounting/measure/comm_probe.py's probe_link fits latency and seconds per byte for each kind from two buffer
sizes;
here the larger size is repeated more and the table printed on rank 0.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 bench/collective_costs.py
    torchrun --nnodes 2 ... bench/collective_costs.py --bandwidth-gbps 0.2   # two hosts at 200 Mbit/s
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.accounting.measure.comm_probe import probe_link
from megatron.accounting.predict.step_time import COST_FACTORS


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth-gbps", type=float, default=None,
                        help="the link's bandwidth in Gbit/s: also print seconds per byte x bytes per second")
    parser.add_argument("--repeats", type=int, default=15, help="timed collectives per kind and size")
    parser.add_argument("--json", default=None, help="also write the table here (rank 0)")
    opts = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    link = probe_link(None, device, backend, repeats=opts.repeats)
    reference = link.costs["all_reduce"].seconds_per_byte
    rows = []
    for kind, cost in link.costs.items():
        row = dict(kind=kind, latency_us=cost.latency_s * 1e6, ns_per_byte=cost.seconds_per_byte * 1e9,
                   vs_all_reduce=cost.seconds_per_byte / reference, assumed=COST_FACTORS[backend][kind])
        if opts.bandwidth_gbps:
            row["factor"] = cost.seconds_per_byte * opts.bandwidth_gbps * 1e9 / 8
        rows.append(row)
    if dist.get_rank() == 0:
        print(f"{backend}, {dist.get_world_size()} ranks; p2p is probed as the broadcast")
        print("| kind | latency (us) | ns per byte sent | vs all-reduce | factor (x bytes/bandwidth) | "
              "COST_FACTORS |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            factor = f"{r['factor']:.2f}" if "factor" in r else "-"
            print(f"| {r['kind']} | {r['latency_us']:.1f} | {r['ns_per_byte']:.3f} | {r['vs_all_reduce']:.2f} | "
                  f"{factor} | {r['assumed']:.2f} |")
        if opts.json:
            Path(opts.json).write_text(json.dumps(rows, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
