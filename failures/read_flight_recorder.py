"""Read the flight recorder dumps of every rank and say which rank did not join which collective, and where.

    python failures/read_flight_recorder.py DIRECTORY [torchfrtrace's options]

DIRECTORY holds one dump per rank, named PREFIX + rank: failures/skipped_collective.py writes them from a
timer thread, as NCCL's watchdog does on a timeout with TORCH_NCCL_DUMP_ON_TIMEOUT=1 (torch's documentation).
This runs torch's analyser, torchfrtrace (python -m torch.distributed.flight_recorder.fr_trace), on a copy of
the dumps whose table of process groups is re-keyed; other options go on to torchfrtrace.

Why re-key: in torch 2.14.1 a gloo dump keys its table of process groups (pg_config) by '', while its entries
name the group '0' (("0", "default_pg")), so torchfrtrace fails with KeyError: ('0', 0) when it looks up an
entry's group. The copy gets one row per group that the entries name, with the ranks of the '' row: right
for the default group, the only one in the failure programs (gloo's dump holds that one row even when there
are other groups, so their ranks are not in it). Dumps whose table names its groups (NCCL's, in torch's
tutorial) are copied unchanged, and the dumps themselves are left as they are.
"""
import argparse
import os
import pickle
import re
import sys
import tempfile

from torch.distributed.flight_recorder import fr_trace


def rekeyed(dump: dict) -> dict:
    """pg_config keyed by the group names of the entries, where gloo keyed it by ''."""
    if set(dump["pg_config"]) != {""}:
        return dump
    ranks = dump["pg_config"][""]["ranks"]
    groups = {tuple(entry["process_group"]) for entry in dump["entries"]}
    if len(groups) > 1:
        print(f"note: the entries name {len(groups)} process groups, and gloo's dump gives the ranks of one "
              f"({ranks}): each is read as holding those ranks", file=sys.stderr)
    return dict(dump, pg_config={name: {"name": name, "desc": desc, "ranks": ranks} for name, desc in groups})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="the dumps, one per rank: PREFIX + rank")
    parser.add_argument("-p", "--prefix", help="the dumps' common prefix (default: guessed, as torchfrtrace does)")
    args, analyser_args = parser.parse_known_args()
    dumps = {name: match for name in sorted(os.listdir(args.directory))
             if (match := re.fullmatch(rf"({re.escape(args.prefix) if args.prefix else r'.*?'})(\d+)", name))}
    prefixes = {match.group(1) for match in dumps.values()}
    if len(prefixes) != 1:
        sys.exit(f"{args.directory}: no dumps named PREFIX + rank, or several prefixes {sorted(prefixes)}: "
                 "give one with --prefix")
    prefix = prefixes.pop()
    with tempfile.TemporaryDirectory() as copy:
        for name in dumps:
            with open(os.path.join(args.directory, name), "rb") as file:
                dump = pickle.load(file)
            with open(os.path.join(copy, name), "wb") as file:
                pickle.dump(rekeyed(dump), file)
        print(f"{len(dumps)} dumps ({prefix}*) from {args.directory}, re-keyed for torchfrtrace", flush=True)
        fr_trace.main([copy, "--prefix", prefix, *analyser_args])


if __name__ == "__main__":
    main()
