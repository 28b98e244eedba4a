"""The rendezvous horovodrun runs on its own host before it starts the processes over ssh, for
slurm/horovod.sbatch, where srun starts them instead: Horovod's gloo rendezvous server, told which
host runs which ranks. Prints the port it listens on, then serves until its batch file ends it.

    python slurm/horovod_rendezvous.py node1:4,node2:4
"""
import sys
import time

from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer


def main():
    hosts = parse_hosts(sys.argv[1])
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(hosts, sum(host.slots for host in hosts)))
    print(port, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
