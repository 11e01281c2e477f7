"""A port already in use: "address already in use" when the ranks meet.

Symptom: the run fails at init_process_group with "The server socket has failed to listen on any local network
address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use" (the port
number is MASTER_PORT's); the other ranks fail to connect, or connect to the wrong job and time out.
Cause: rank 0 hosts the store where the ranks meet, on MASTER_PORT (torchrun's default 29500), and another process
holds that port: a second run on the same machine with the same port, or a previous run that has not ended yet.
Find it: ss -ltnp | grep 29500 (or lsof -i :29500) names the process that holds the port.
Fix: a port that is free: ask the operating system for one (bind to port 0, read the port, close the socket, as
free_port() in _launch.py does; another process can take it in between, so check for this error and retry),
or let torchrun choose (torchrun --standalone, or --rdzv-endpoint=localhost:0), or give each run its own
MASTER_PORT.

    python failures/port_in_use.py          # EADDRINUSE, exit 1
    python failures/port_in_use.py --fixed  # both ranks join, exit 0
"""
import socket

import torch.distributed as dist
from _launch import free_port, launch, parse


def main(rank, world_size, args):
    print(f"rank {rank} of {dist.get_world_size()}: joined the process group")


if __name__ == "__main__":
    args = parse(__doc__)
    with socket.socket() as previous_run:  # a run still holding its port: here a socket listening on it
        previous_run.bind(("127.0.0.1", 0))
        previous_run.listen()
        port = previous_run.getsockname()[1]  # the port this run was told to use (MASTER_PORT)
        if args.fixed:  # the fix: a port that is free now
            port = free_port()
        launch(main, args, port=port)
