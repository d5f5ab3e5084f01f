"""``zeroth launch``: the same command on every host starts one process of a run on each.

  zeroth launch CONFIG --rendezvous HOST:PORT --out DIR [--nnodes N | MIN:MAX] [--node-rank R]
                [--secret-file F | --insecure] [--advertise HOST] [--port P] [--startup-timeout S]
                [--tls-dir DIR] [--set SECTION.FIELD=VALUE ...]

The launchers meet at the rendezvous (:mod:`zeroth.transport.rendezvous`; the launcher whose host
owns the rendezvous address serves it), each gets a rank and the roster of every host's
advertised address, and each starts its system's process for its role:

=================  ==========================  ==========================================
config section     hosts (``--nnodes``)        rank r runs
=================  ==========================  ==========================================
``peers``          ``peers.count`` (MIN:MAX)   a Just One Byte peer; rank 0 founds the run
``pipeline``       ``pipeline.stages`` ×       stage ``r mod S`` of replica ``r div S`` (AQ-SGD;
                   ``pipeline.replicas``       ``S`` = ``pipeline.stages``)
``ravnest``        ``len(ravnest.nodes)``      Ravnest node ``ravnest.nodes[r].name``
``binary``         ``binary.workers + 1``      the sparse-mutation server (rank 0) or a worker
``runs`` (Marsit)  N (default 1)               process r of one ``jax.distributed`` job,
                                               ``topology.workers / N`` CPU devices each
=================  ==========================  ==========================================

Each host writes its own folder ``OUT`` (``launch.json``: rank, role, roster; the system's
folder below it: ``peers/p<r>``, ``stage_<i>`` (replica ``k > 0``: ``replica_<k>/stage_<i>``, as
``zeroth run`` lays them out), ``nodes/<name>``, ``marsit``); folders collected from every
host into one place are one run (``zeroth verify`` reads every update log below a folder).

A pipeline with ``pipeline.replicas`` R > 1 takes R × S hosts: replica 0 of stage ``i`` serves the
averaging of that stage on its host's port + 1 (``--port P``: P and P + 1; by default a free pair),
only to the streams signed by the keys the other replicas of the stage brought to the rendezvous;
the other replicas of stage ``i`` connect to it there.

A run fails loudly, with one line and a non-zero exit: fewer hosts than ``--nnodes`` (its MIN)
within the start-up window, a rendezvous that cannot be reached, a host with another config or
another zeroth, a rank taken twice. The rank comes from ``--node-rank``, else the scheduler
(``SLURM_PROCID``, ``JOB_COMPLETION_INDEX`` of a Kubernetes indexed Job), else the order of arrival.

Secure by default: every call (rendezvous included) carries the access token of the run secret
(``--secret-file``, else ``$ZEROTH_SECRET``), and ``--tls-dir`` (made by ``zeroth certs``) adds
mutual TLS to the rendezvous and to every link of the run (peers, stages, nodes).

Example (three hosts, the same line on each):
  $ zeroth launch experiments/job_digits.yaml --rendezvous 10.0.0.1:29400 --nnodes 3 \\
        --secret-file run.secret --out runs/job
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from zeroth import __version__, marsit
from zeroth import config as _config
from zeroth.transport import identity, rendezvous, security

__all__ = [
    "Plan",
    "plan_of",
    "build_parser",
    "main",
]

EXIT_FAILED = 1  # the run could not form, or this host's process failed
EXIT_USAGE = 2  # a bad command line or config


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a config runs as across hosts: its system, how many hosts it takes (``min_nodes`` to
    ``max_nodes``) and whether a host may arrive after the run formed."""

    system: str
    min_nodes: int
    max_nodes: int
    late_joins: bool


def plan_of(cfg: _config.Config, nnodes: str | None) -> Plan:
    """The :class:`Plan` of ``cfg`` with ``--nnodes`` (``N``, ``MIN:MAX`` or None: the config's count).

    Raises:
      ValueError: a system that does not run across hosts yet, or ``--nnodes`` that disagrees with the config.
    """
    system = cfg.system  # the union's tag: at most one system section
    if system is None:
        raise ValueError(
            "zeroth launch runs configs with a peers:, pipeline:, ravnest: or binary: section or a "
            "Marsit runs: list; this config trains on one machine: use `zeroth run`"
        )
    if system == "binary" and cfg.binary.workers < 1:
        raise ValueError("binary.workers is 0: the sparse-mutation run has no workers to launch on other hosts")
    count = {
        "peers": lambda: cfg.peers.count,
        "pipeline": lambda: cfg.pipeline.stages * cfg.pipeline.replicas,
        "ravnest": lambda: len(cfg.ravnest.nodes),
        "binary": lambda: cfg.binary.workers + 1,
    }[system]()
    elastic = system == "peers"  # only peers admit a host after the run formed
    if nnodes is None:
        return Plan(system, count, count, elastic)
    lo, sep, hi = str(nnodes).partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"--nnodes {nnodes!r}: expected N or MIN:MAX (whole numbers)") from None
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"--nnodes {nnodes!r}: need 1 <= MIN <= MAX")
    if sep and not elastic:
        raise ValueError(
            f"--nnodes {nnodes}: a {system} run has a fixed number of hosts ({count}); give --nnodes {count}"
        )
    if not elastic and lo_n != count:
        pipe = (
            "pipeline.stages"
            if cfg.pipeline is None or cfg.pipeline.replicas == 1
            else ("pipeline.stages × pipeline.replicas")
        )
        field = {"pipeline": pipe, "ravnest": "len(ravnest.nodes)", "binary": "binary.workers + 1"}[system]
        raise ValueError(
            f"--nnodes {nnodes}: the config's {field} is {count}; give --nnodes {count} or change the config"
        )
    if elastic and not sep and lo_n != count:
        raise ValueError(
            f"--nnodes {nnodes}: the config's peers.count is {count}; give --nnodes {count}, "
            f"--set peers.count={lo_n}, or --nnodes MIN:MAX for a run that admits hosts as they come"
        )
    return Plan(system, lo_n, hi_n, elastic)


def marsit_plan(runs, nnodes: str | None) -> Plan:
    """The :class:`Plan` of a Marsit config's ``runs``: ``--nnodes`` processes (default 1), each with
    an equal share of the workers (CPU devices), in one ``jax.distributed`` job.

    Raises:
      ValueError: ``--nnodes`` that is not a whole number dividing every run's worker count.
    """
    from zeroth.marsit.process import local_devices

    try:
        n = int(nnodes or 1)
    except ValueError:
        raise ValueError(f"--nnodes {nnodes!r}: a Marsit run takes a fixed number of processes (N)") from None
    if n < 1:
        raise ValueError(f"--nnodes {nnodes}: need at least 1")
    local_devices(runs, n)
    return Plan("marsit", n, n, False)


def node_rank_from_env(environ=None) -> int | None:
    """The rank a scheduler gave this process: ``SLURM_PROCID`` (srun, one task per host) or
    ``JOB_COMPLETION_INDEX`` (a Kubernetes indexed Job); None when neither is set."""
    environ = os.environ if environ is None else environ
    for key in ("SLURM_PROCID", "JOB_COMPLETION_INDEX"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zeroth launch``."""
    p = argparse.ArgumentParser(
        prog="zeroth launch",
        description="Start this host's process of a run across hosts (the same command on every host).",
    )
    p.add_argument("config", help="experiment YAML (the same on every host)")
    p.add_argument(
        "--rendezvous",
        required=True,
        metavar="HOST:PORT",
        help="where the hosts meet; the host that owns this address serves it",
    )
    p.add_argument("--out", required=True, help="this host's run folder")
    p.add_argument(
        "--nnodes",
        default=None,
        metavar="N|MIN:MAX",
        help="hosts in the run (default: the config's count); "
        "MIN:MAX where the system admits late hosts (Just One Byte)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this host's rank (default: $SLURM_PROCID, $JOB_COMPLETION_INDEX, else the order of arrival)",
    )
    p.add_argument(
        "--secret-file", default=None, help="the run secret (the same file on every host; default $ZEROTH_SECRET)"
    )
    p.add_argument("--insecure", action="store_true", help="no run secret: anyone who reaches a port may take part")
    p.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="the address the other hosts reach this one at "
        "(default: this host's source address on the route to the rendezvous)",
    )
    p.add_argument("--port", type=int, default=0, help="the port this host's process serves on (default: a free one)")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds for every host to join (default: peers.startup_timeout_s, else 60 + 4 per host)",
    )
    p.add_argument(
        "--tls-dir",
        default=None,
        help="mutual TLS: a folder made by `zeroth certs` (ca.pem and this host's ADVERTISE/ or HOSTNAME/ certificate)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="config override (the same on every host)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _free_port(host: str = "0.0.0.0") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _free_port_pair(host: str = "0.0.0.0") -> int:
    """A port P such that P and P + 1 are both free now (a replica-0 stage serves its link on P, the averaging on P + 1)."""
    for _ in range(64):
        p = _free_port(host)
        if p >= 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, p + 1))
            except OSError:
                continue
        return p
    raise OSError("found no two consecutive free ports for a pipeline stage and its averaging; give --port P")


def _secret(args) -> str | None:
    if args.insecure:
        if args.secret_file:
            raise ValueError("--insecure and --secret-file were both given; choose one")
        return None
    if args.secret_file:
        return identity.read_secret(args.secret_file)
    secret = identity.secret_from_env()
    if secret is None:
        raise ValueError(
            "every host needs the same run secret: --secret-file FILE (made once, e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(32))' > run.secret`, copied to every host "
            f"over a private channel) or ${identity.SECRET_ENV[0]}; or --insecure"
        )
    return secret


def main(argv: list[str]) -> int:
    """Entry point of ``zeroth launch``; returns the exit code."""
    args = build_parser().parse_args(argv)
    out = Path(args.out)

    def say(text: str) -> None:
        if not args.quiet:
            print(f"zeroth launch: {text}", file=sys.stderr, flush=True)

    def fail(code: int, text: str) -> int:
        print(f"zeroth launch: error: {text}", file=sys.stderr, flush=True)
        return code

    try:
        raw = marsit.config.read_config(args.config)
        if marsit.is_config(raw):
            cfg = marsit.load_runs_dict(raw, args.overrides, where=args.config)
            plan = marsit_plan(cfg, args.nnodes)
            config_text = yaml.safe_dump(
                {"name": raw.get("name"), "runs": [marsit.config.spec_dict(r) for r in cfg]}, sort_keys=False
            )
        else:
            cfg = _config.load_config(args.config, args.overrides)
            plan = plan_of(cfg, args.nnodes)
            config_text = _config.to_yaml(cfg)
        secret = _secret(args)
        host, port = rendezvous.split_address(args.rendezvous)
        if not port:
            raise ValueError(f"--rendezvous {args.rendezvous!r}: expected HOST:PORT")
        if host in ("0.0.0.0", "::", ""):
            raise ValueError(f"--rendezvous {args.rendezvous!r}: give an address the other hosts can reach")
        rank = args.node_rank if args.node_rank is not None else node_rank_from_env()
        if rank is not None and not 0 <= rank < plan.max_nodes:
            raise ValueError(f"--node-rank {rank}: the ranks of this run are 0..{plan.max_nodes - 1}")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port {args.port}: a port is 0..65535")
        pair = plan.system == "pipeline" and cfg.pipeline.replicas > 1
        if pair and args.port == 65535:
            raise ValueError(f"--port {args.port}: a replicated pipeline stage also serves its averaging on port + 1")
        advertise = args.advertise or rendezvous.route_source(args.rendezvous)
        tls = security_files(args.tls_dir, advertise) if args.tls_dir else None
        window = args.startup_timeout
        if window is None:
            window = (
                cfg.peers.startup_timeout_s if plan.system == "peers" and cfg.peers.startup_timeout_s else None
            ) or rendezvous.startup_window(plan.max_nodes)
        if not window > 0:
            raise ValueError(f"--startup-timeout {window}: must be positive seconds")
        if out.exists() and (out / "launch.json").exists():
            raise ValueError(f"{out} already holds a launched run (launch.json); choose another --out")
    except (ValueError, OSError) as e:
        return fail(EXIT_USAGE, str(e))

    digest = hashlib.sha256(config_text.encode()).hexdigest()
    my_port = args.port or (_free_port_pair() if pair else _free_port())
    token = identity.access_token(secret) if secret else None
    store = rendezvous.Store(
        min_nodes=plan.min_nodes,
        max_nodes=plan.max_nodes,
        timeout_s=window,
        config_digest=digest,
        version=__version__,
        late_joins=plan.late_joins,
        last_call_s=min(10.0, window / 4),
    )
    server = rendezvous.serve(store, f"{host}:{port}", token=token, tls=tls)
    if server is not None:
        say(
            f"serving the rendezvous on {args.rendezvous} for {plan.min_nodes}"
            f"{'' if plan.min_nodes == plan.max_nodes else f'..{plan.max_nodes}'} hosts "
            f"(start-up window {window:g}s)"
        )
    client = rendezvous.Client(args.rendezvous, token=token, tls=tls)
    deadline = time.monotonic() + window + 5.0
    # a pipeline stage's key goes through the rendezvous: the next stage serves only its signed stream
    me = identity.Identity.generate() if plan.system == "pipeline" else None
    try:
        rank, late = client.join(
            config_digest=digest,
            version=__version__,
            advertise=f"{advertise}:{my_port}",
            node_rank=-1 if rank is None else rank,
            hostname=socket.gethostname(),
            deadline=deadline,
            key=me.public if me is not None else b"",
        )
        say(
            f"joined the rendezvous at {args.rendezvous} as rank {rank}{' (late)' if late else ''}, "
            f"advertising {advertise}:{my_port}"
        )
        roster = client.wait_formed(
            deadline,
            progress=lambda r: say(f"{r.joined} of {r.min_nodes} hosts joined ({r.waited_s:.0f}s of {window:g}s)"),
        )
    except rendezvous.Refused as e:
        if server is not None:  # the others read why from the roster before this host goes away
            time.sleep(2.0)
            server.stop(0)
        return fail(EXIT_FAILED, str(e))
    finally:
        client.close()
    say(f"the run formed with {roster.nodes} hosts: " + ", ".join(f"{m.rank}={m.advertise}" for m in roster.members))
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    config_path.write_text(config_text)
    if plan.system == "marsit":  # the Marsit processes read the config as the user wrote it, with the same --set
        config_path = Path(args.config).resolve()
    identity_file = me.save(out / "identity.key") if me is not None else None
    role, cmd, env = _role(
        plan,
        cfg,
        config_path,
        out,
        rank,
        late,
        roster,
        my_port,
        advertise,
        secret,
        tls,
        window,
        args.overrides,
        identity_file,
    )
    record = {
        "rank": rank,
        "late": late,
        "role": role,
        "system": plan.system,
        "config_digest": digest,
        "version": __version__,
        "rendezvous": args.rendezvous,
        "advertise": f"{advertise}:{my_port}",
        "served_rendezvous": server is not None,
        "roster": [dataclasses.asdict(m) for m in roster.members],
        "command": cmd,
    }
    (out / "launch.json").write_text(json.dumps(record, indent=1) + "\n")
    say(f"rank {rank} runs {role}")
    code = _run(cmd, env)
    if server is not None:
        server.stop(1.0)
    if code == 0:
        say(f"rank {rank} ({role}) finished")
    else:
        print(
            f"zeroth launch: rank {rank} ({role}) exited with code {code}; its folder: {out}",
            file=sys.stderr,
            flush=True,
        )
    return code


def security_files(tls_dir: str, advertise: str) -> security.TLSFiles:
    """This host's mutual TLS files in ``tls_dir`` (see :func:`zeroth.transport.certs.host_tls`)."""
    from zeroth.transport import certs

    return certs.host_tls(tls_dir, [advertise, socket.gethostname(), socket.getfqdn()])


def _tls_args(tls: security.TLSFiles | None) -> list[str]:
    if tls is None:
        return []
    return ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca] + (["--tls-mutual"] if tls.mutual else [])


def _role(
    plan: Plan,
    cfg,
    config_path: Path,
    out: Path,
    rank: int,
    late: bool,
    roster,
    port: int,
    advertise: str,
    secret: str | None,
    tls,
    window: float,
    overrides: list[str],
    identity_file: Path | None = None,
) -> tuple[str, list[str], dict]:
    """``(role, command, environment)`` of this host's process; ``identity_file``: the private key
    it signs with (its public half is in the roster: a pipeline stage's upstream key)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    py = [sys.executable, "-m", "zeroth"]
    members = {m.rank: m.advertise for m in roster.members}
    if plan.system == "marsit":
        # each process sets its own device count; jax's coordinator listens on rank 0's advertised port
        env["XLA_FLAGS"] = " ".join(
            f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
        )
        cmd = [
            sys.executable,
            "-m",
            "zeroth.marsit.process",
            "--config",
            str(config_path),
            "--out",
            str(out / "marsit"),
            "--coordinator",
            members[0],
            "--num-processes",
            str(roster.nodes),
            "--process-id",
            str(rank),
            "--hostname",
            advertise,
            "--timeout",
            f"{window:g}",
            *[a for o in overrides for a in ("--set", o)],
        ]
        return f"Marsit process {rank} of {roster.nodes}", cmd, env
    insecure = [] if secret else ["--insecure"]
    if secret:
        env[identity.SECRET_ENV[0]] = secret  # the stages and nodes read it there; never on a command line
    if plan.system == "peers":
        cmd = [
            *py,
            "peer",
            "--config",
            str(config_path),
            "--listen",
            f"0.0.0.0:{port}",
            "--advertise",
            f"{advertise}:{port}",
            "--out",
            str(out / "peers" / f"p{rank}"),
            "--startup-timeout",
            f"{window:g}",
            "--progress-every",
            "10",
            *insecure,
            *_tls_args(tls),
        ]
        if rank == 0 and not late:
            cmd += ["--founders", str(roster.nodes)]
        else:
            cmd += ["--join", members[0]] + ([] if late else ["--join-members", str(rank)])
        return ("founder" if rank == 0 and not late else f"peer {rank}{' (late)' if late else ''}"), cmd, env
    if plan.system == "pipeline":
        s, R = cfg.pipeline.stages, cfg.pipeline.replicas
        replica, stage = divmod(rank, s)
        keys = {m.rank: m.key for m in roster.members}
        folder = out if replica == 0 else out / f"replica_{replica}"
        cmd = [
            *py,
            "stage",
            "--config",
            str(config_path),
            "--stage",
            str(stage),
            "--out",
            str(folder / f"stage_{stage}"),
            *insecure,
            *_tls_args(tls),
        ]
        if identity_file is not None:
            cmd += ["--identity", str(identity_file)]
        if stage > 0:
            cmd += ["--listen", f"0.0.0.0:{port}"]
            if keys.get(rank - 1):
                cmd += ["--upstream-key", keys[rank - 1]]
        if stage < s - 1:
            cmd += ["--next", members[rank + 1]]
        if R == 1:
            return f"stage {stage} of {s}", cmd, env
        cmd += ["--replica", str(replica)]
        if replica == 0:  # serves the stage's averaging on port + 1, to the streams its replicas' keys signed
            cmd += ["--sync-listen", f"0.0.0.0:{port + 1}"]
            for k in range(1, R):
                if keys.get(k * s + stage):
                    cmd += ["--replica-key", f"{k}={keys[k * s + stage]}"]
        else:
            host, server_port = rendezvous.split_address(members[stage])
            cmd += ["--sync-server", f"{f'[{host}]' if ':' in host else host}:{server_port + 1}"]
        return f"stage {stage} of {s}, replica {replica} of {R}", cmd, env
    if plan.system == "binary":
        if rank == 0:
            cmd = [
                sys.executable,
                "-m",
                "zeroth.binary.serve",
                "--config",
                str(config_path),
                "--out",
                str(out / "server"),
                "--listen",
                f"0.0.0.0:{port}",
                *insecure,
                *_tls_args(tls),
            ]
            return "binary-learning server", cmd, env
        from zeroth.binary import experiment as binary_experiment

        dist = binary_experiment.dist_config(cfg)
        cmd = [
            sys.executable,
            "-m",
            "zeroth.binary.worker",
            "--server",
            members[0],
            "--config",
            json.dumps(dist._asdict()),
            "--metrics",
            str(out / "worker.jsonl"),
            *insecure,
            *_tls_args(tls),
        ]
        return f"binary-learning worker {rank}", cmd, env
    names = [n["name"] for n in cfg.ravnest.nodes]
    book = out / "addresses"
    book.mkdir(parents=True, exist_ok=True)
    for r, address in members.items():  # every other node's address from the roster; this node writes its own
        if r != rank:
            (book / names[r]).write_text(address + "\n")
    cmd = [
        *py,
        "node",
        "--config",
        str(config_path),
        "--name",
        names[rank],
        "--out",
        str(out / "nodes" / names[rank]),
        "--addresses",
        str(book),
        "--listen",
        f"0.0.0.0:{port}",
        "--advertise",
        advertise,
        *insecure,
        *_tls_args(tls),
    ]
    return f"Ravnest node {names[rank]}", cmd, env


# Run first in the child: ask Linux for SIGTERM when the launcher dies (PR_SET_PDEATHSIG; a launcher
# killed by its scheduler must not leave its process running), leave at once if it died already,
# then become the command. Not a preexec_fn: forking a process with gRPC's threads runs gRPC's fork
# handlers in the child, which aborted it now and then ("epoll_wait error: Bad file descriptor").
_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(143)\n"
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def _run(cmd: list[str], env: dict) -> int:
    """Run this host's process; SIGINT/SIGTERM are passed on to it (it saves and stops as it does alone),
    and on Linux it gets SIGTERM if the launcher dies."""
    if sys.platform == "linux":
        cmd = [sys.executable, "-c", _WITH_PARENT, str(os.getpid()), *cmd]
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
