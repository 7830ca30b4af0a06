"""A real two-node Slurm cluster on this machine, for the tests and ``make slurm-up``.

One controller and two node daemons on loopback (``slurmd -N n1`` / ``-N n2``, each with
its own port, spool and log), authenticated by a munge daemon of their own (own key and
socket), all configured and kept under one temporary folder::

    cluster = Cluster.create(Path("/tmp/seg-slurm"))
    cluster.start()                       # munged, slurmctld, 2 x slurmd; waits for idle
    job = cluster.sbatch(["-N2", "script.sbatch"], env)
    cluster.wait(job)
    cluster.stop()                        # its own pids only; returns what was left running

Clients reach it through ``SLURM_CONF`` (:attr:`Cluster.env`). Every daemon runs in the
foreground as a child of this process; :meth:`Cluster.stop` cancels the jobs, stops the
daemons by pid, then looks for any process still carrying the cluster's mark (job steps,
their children) and ends those by pid too. No accounting database: ``sacct`` is not
available, job completions go to ``log/jobcomp.txt`` and ``scontrol show job`` holds the
requeue count (``Restarts=``).

Only the standard library: ``tools/slurm_cluster.py`` runs it without the project.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cluster", "unavailable", "PACKAGES", "MARK"]

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")  # Debian's, Slurm 22.05
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue",
            "scancel")
MARK = "SEG_SLURM_CLUSTER"  # in the daemons' environment: their job steps inherit it
NODES = ("n1", "n2")
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def unavailable() -> str | None:
    """Why a cluster cannot start here (missing packages, not root), or None."""
    missing = [b for b in BINARIES if shutil.which(b, path=_sbin_path()) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found): as root, "
                f"apt-get install -y {' '.join(PACKAGES)} (.ci/run does)")
    if os.geteuid() != 0:
        return "the test cluster's slurmd must run as root (it starts job steps as their user)"
    return None


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", "/usr/bin:/bin"), "/usr/sbin", "/sbin"])


def _which(name: str) -> str:
    path = shutil.which(name, path=_sbin_path())
    if path is None:
        raise FileNotFoundError(f"{name} not found: apt-get install -y {' '.join(PACKAGES)}")
    return path


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on loopback (held together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Cluster:
    """A controller, two node daemons and munge under ``root``; see the module docstring.

    Attributes:
        root: the folder that holds its config, keys, sockets, state, spool and logs.
        name: ``ClusterName`` (distinct per pytest-xdist worker).
        first_job_id: ``FirstJobId``; Lightning derives the rendezvous port from the job id
            (15000 + its last 4 digits), so clusters that run side by side number apart.
        pids: daemon name -> pid, once started.
    """

    root: Path
    name: str = "segtest"
    first_job_id: int = 1
    pids: dict[str, int] = field(default_factory=dict)
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @classmethod
    def create(cls, root: Path, name: str = "segtest", first_job_id: int = 1) -> Cluster:
        """A new cluster's folders under ``root`` (world-traversable: munge requires it)."""
        root.mkdir(parents=True, exist_ok=True)
        for sub in ("run", "log", "state", "spool"):
            (root / sub).mkdir(exist_ok=True)
        (root / "munge").mkdir(mode=0o700, exist_ok=True)
        for folder in (root, root / "run"):
            folder.chmod(0o755)
        return cls(root, name, first_job_id)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _daemon_env(self) -> dict[str, str]:
        return {"PATH": _sbin_path(), "SLURM_CONF": str(self.conf), MARK: str(self.root)}

    # ----- configuration ------------------------------------------------------------

    def write_config(self) -> None:
        """``slurm.conf`` and ``cgroup.conf`` for two 1-CPU nodes on loopback."""
        ctld, *node_ports = free_ports(1 + len(NODES))
        host = socket.gethostname().split(".")[0]
        r = self.root
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs=1 "
            f"RealMemory=8000 State=UNKNOWN" for n, p in zip(NODES, node_ports))
        self.conf.write_text(f"""\
# written by tests/slurm/cluster.py: a two-node test cluster on one machine
ClusterName={self.name}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={node_ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/run/munge.sock
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
# processes tracked by parent pid, no cgroups, no task binding: runs in a container too
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
FirstJobId={self.first_job_id}
JobRequeue=1
ReturnToService=2
SlurmdTimeout=30
MessageTimeout=10
KillWait=15
# a loaded 2-core test machine: a killed step's processes may take long to be reaped
UnkillableStepTimeout=180
MinJobAge=600
# no slurmdbd: sacct is unavailable; completions are logged here and scontrol show job
# holds the requeue count (Restarts=)
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        (r / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)

    # ----- start / stop -------------------------------------------------------------

    def _spawn(self, name: str, cmd: Sequence[str], detach: bool) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the child's
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self._daemon_env(),
                                cwd=self.root, start_new_session=detach)
        log.close()
        self._procs.append(proc)
        self.pids[name] = proc.pid
        (self.root / "run" / "pids.json").write_text(json.dumps(self.pids))

    def start(self, timeout: float = 60, detach: bool = False) -> None:
        """Write the config, start munged, slurmctld and both slurmd; wait for idle nodes.

        Args:
            timeout: seconds to wait for both nodes to be idle.
            detach: new sessions for the daemons (``make slurm-up``: they outlive it).

        Raises:
            RuntimeError: a daemon exited or the nodes never came up (its log's tail).
        """
        self.write_config()
        r = self.root
        self._spawn("munged", [_which("munged"), "-F", f"--key-file={r}/munge/munge.key",
                               f"--socket={r}/run/munge.sock",
                               f"--pid-file={r}/run/munged.pid",
                               f"--seed-file={r}/munge/seed", f"--log-file={r}/log/munged.log",
                               "--num-threads=4"], detach)
        self._wait_for(lambda: (r / "run" / "munge.sock").exists(), 10, "munged")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(self.conf)], detach)
        for node in NODES:
            self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node, "-f",
                                           str(self.conf)], detach)
        self._wait_for(lambda: self.node_states() == {n: "idle" for n in NODES}, timeout,
                       "both nodes idle")

    def _wait_for(self, ready: object, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not ready():  # type: ignore[operator]
            for name, pid in self.pids.items():
                if not _alive(pid):
                    raise RuntimeError(f"{name} exited while waiting for {what}: "
                                       f"{self.log_tail(name)}")
            if time.monotonic() > end:
                raise RuntimeError(f"no {what} after {timeout} s: {self.log_tail('slurmctld')}")
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The end of a daemon's log (its own file, else what it printed)."""
        base = name.replace("slurmd-", "slurmd.")
        for path in (self.root / "log" / f"{base}.log", self.root / "log" / f"{name}.out"):
            if path.exists() and path.stat().st_size:
                return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def stop(self, timeout: float = 30) -> list[str]:
        """Cancel every job, stop the daemons by pid; end any process left with the mark.

        Returns:
            ``"pid name"`` of each process that was still running after the daemons stopped
            (each has been killed): empty when the cluster shut down cleanly.
        """
        if "slurmctld" in self.pids and _alive(self.pids["slurmctld"]):
            self.client("scancel", "--user", str(os.getuid()), check=False)
            end = time.monotonic() + timeout
            while self.client("squeue", "-h", check=False).stdout.strip():
                if time.monotonic() > end:
                    break
                time.sleep(0.3)
        order = [n for n in (*(f"slurmd-{n}" for n in NODES), "slurmctld", "munged")
                 if n in self.pids]
        for name in order:
            if _marked(self.pids[name], self.root):  # not a pid reused by another program
                _end(self.pids[name], timeout)
        for proc in self._procs:
            proc.poll()  # reap our own children
        left = marked_processes(self.root)
        for pid, _ in left:
            _end(pid, 5)
        self.pids.clear()
        (self.root / "run" / "pids.json").unlink(missing_ok=True)
        return [f"{pid} {name}" for pid, name in left]

    # ----- clients ------------------------------------------------------------------

    def client(self, *cmd: str, check: bool = True, env: Mapping[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster."""
        full = {"PATH": _sbin_path(), **(env or {}), **self.env}
        out = subprocess.run(list(cmd), capture_output=True, text=True, env=full,
                             timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}")
        return out

    def node_states(self) -> dict[str, str]:
        out = self.client("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def settle(self, timeout: float = 240) -> str:
        """No job left, both nodes idle: what a test on the cluster starts from.

        Jobs still queued are cancelled; nodes still completing (killing a step's processes)
        are waited for; a node the controller drained or set down (a step it could not kill,
        a node daemon that stopped answering) is resumed, since it would leave every later
        two-node job pending.

        Returns:
            ``""`` when nothing was left, else what was (jobs, node states, ``sinfo -R``'s
            reasons and the daemons' log tails).

        Raises:
            RuntimeError: the nodes were not idle ``timeout`` s after that.
        """
        idle = {n: "idle" for n in NODES}
        left: list[str] = []  # jobs found queued or running (not merely completing)
        end = time.monotonic() + timeout
        while True:
            queue = self.client("squeue", "-h", "-o", "%i %T", check=False).stdout.split("\n")
            jobs = [line for line in queue if line.strip()]
            stuck = [j for j in jobs if not j.endswith(" COMPLETING")]
            if stuck:
                left += [j for j in stuck if j not in left]
                self.client("scancel", "--user", str(os.getuid()), check=False)
            states = self.node_states()
            if not jobs and (states == idle or all(
                    s in ("idle", "drain", "down", "down*", "drain*") for s in states.values())):
                break  # nothing is completing any more
            if time.monotonic() > end:
                break
            time.sleep(0.5)
        if not left and states == idle:
            return ""
        reasons = self.client("sinfo", "-R", "-h", "-o", "%N %T %E", check=False).stdout
        problem = (f"jobs left {left}, nodes {states}, reasons {reasons.strip()!r}\n"
                   + "\n".join(f"--- {name}\n{self.log_tail(name, 25)}"
                                for name in ("slurmctld", *(f"slurmd-{n}" for n in NODES))))
        for node, state in states.items():
            if state != "idle":
                self.client("scontrol", "update", f"NodeName={node}", "State=RESUME",
                            check=False)
        self._wait_for(lambda: self.node_states() == idle, max(end - time.monotonic(), 30),
                       "both nodes idle again")
        return problem

    def sbatch(self, args: Sequence[str], env: Mapping[str, str]) -> int:
        """Submit a batch job with ``env`` as its whole environment; its job id."""
        return int(self.client("sbatch", "--parsable", *args, env=env).stdout.split(";")[0])

    def job(self, job_id: int | str) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ``ExitCode``, ...)."""
        out = self.client("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, job_id: int | str, timeout: float = 300,
             states: Sequence[str] = FINISHED) -> dict[str, str]:
        """Poll until the job is in one of ``states`` (finished by default); its record."""
        end = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] in states:
                return info
            if time.monotonic() > end:
                raise TimeoutError(f"job {job_id} still {info['JobState']} after {timeout} s")
            time.sleep(0.25)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _end(pid: int, timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` s; reap it if it is our child."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while _alive(pid) and time.monotonic() < end:
            _reap(pid)
            time.sleep(0.05)
        _reap(pid)
        if not _alive(pid):
            return


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _marked(pid: int, root: Path) -> bool:
    """The process carries this cluster's mark, or ``SLURM_CONF`` naming its config."""
    marks = (f"{MARK}={root}".encode(), f"SLURM_CONF={root}/slurm.conf".encode())
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(m in environ for m in marks)


def marked_processes(root: Path) -> list[tuple[int, str]]:
    """Live processes of this cluster (daemons, job steps, their children): pid, name."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        if _marked(pid, root) and _alive(pid):
            try:
                found.append((pid, (entry / "comm").read_text().strip()))
            except OSError:
                continue
    return found
