"""`polytinker jobs`, `checkpoints`, `audit`, `usage` and `status`: a tenant's view of a running
scheduler from a shell, through :class:`polytinker.client.ServiceClient` (``--scheduler`` and
``--api-key``, or ``$POLYTINKER_SCHEDULER`` and ``$POLYTINKER_API_KEY``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from datetime import UTC, datetime
from typing import Any

from polytinker.client.service_client import ServiceClient
from polytinker.errors import ConfigError
from polytinker.scheduler._cli import client_curve
from polytinker.scheduler.service.messages import AUDIT_EVENT_TYPES


def _client(args: argparse.Namespace) -> ServiceClient:
    address = args.scheduler or os.environ.get("POLYTINKER_SCHEDULER")
    if not address:
        raise ConfigError("pass --scheduler tcp://HOST:PORT or set POLYTINKER_SCHEDULER")
    key = args.api_key or os.environ.get("POLYTINKER_API_KEY")
    return ServiceClient(address, api_key=key, curve=client_curve(args), timeout_s=30.0)


def _print_jobs(jobs: list[dict[str, Any]], load: dict[str, Any]) -> None:
    """The job table (CALLS: calls served by this scheduler process; IDLE: since the last call;
    under a job that does not run, its reason: where it is in the queue and what it waits for),
    then the tenant's load: calls in flight, completed, refused as overloaded, answered waiting."""
    print(f"{'JOB':<22} {'KIND':<9} {'STATE':<10} {'AGENT':<12} {'PRIO':>4} {'CALLS':>6} {'IDLE':>6}  AGE")
    for j in jobs:
        age = time.time() - j["created_s"]
        calls = str(j["calls"]) if "calls" in j else "-"
        idle = f"{j['idle_s']:.0f}s" if "idle_s" in j else "-"
        print(
            f"{j['job_id']:<22} {j['kind']:<9} {j['state']:<10} {j['agent']:<12} {j['priority']:>4} {calls:>6} "
            f"{idle:>6}  {age:.0f}s"
        )
        if j["state"] in ("queued", "preempting", "paused") and j.get("reason"):  # why it does not run
            print(f"    {j['reason']}")
    if load:
        states = ", ".join(f"{n} {s}" for s, n in load.get("jobs", {}).items() if n)
        print(
            f"tenant {load['tenant']}: {load['in_flight']} calls in flight, {load['completed']} completed, "
            f"{load['refused']} refused (overloaded), {load['waiting']} answered waiting; jobs: {states or 'none live'}"
        )


def _jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.jobs_command == "list":
            report = client.jobs_report(include_finished=not args.live)
            if args.json:
                print(json.dumps(report["jobs"], indent=2))
                return 0
            _print_jobs(report["jobs"], report["load"])
            return 0
        if args.jobs_command == "show":
            print(json.dumps(client.get_job(args.job_id), indent=2))
            return 0
        action = {"cancel": client.cancel_job, "pause": client.pause_job, "resume": client.resume_job}
        job = action[args.jobs_command](args.job_id)
        print(f"{job['job_id']}: {job['state']}")
        return 0


def _checkpoints(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.checkpoints_command == "delete":
            deleted = client.delete_checkpoint(args.job_id, args.name)
            files = "its files deleted" if deleted else "its files kept (still in use; see docs/client.md)"
            print(f"{args.job_id}/{args.name}: deleted, {files}")
            return 0
        if args.checkpoints_command in ("publish", "unpublish"):
            public = args.checkpoints_command == "publish"
            was = (client.publish_checkpoint if public else client.unpublish_checkpoint)(args.job_id, args.name)
            state = "published (every tenant may read it)" if public else "private (this tenant's alone)"
            print(f"{args.job_id}/{args.name}: {state}{'' if was != public else ', as it was'}")
            return 0
        if args.checkpoints_command in ("export", "download"):
            out = client.export_weights(args.model_path, args.out, merged=args.merged, overwrite=args.overwrite)
            what = "merged Hugging Face model" if args.merged else "peft adapter"
            print(f"{args.model_path}: {what} in {out}")
            return 0
        rows = []
        for job in client.list_jobs(include_finished=True):
            if job["kind"] == "inference":
                continue
            detail = client.get_job(job["job_id"])
            adapter = detail.get("adapter") or {}
            rows.append(
                {
                    "job_id": job["job_id"],
                    "agent": job["agent"],
                    "state": job["state"],
                    "latest": adapter.get("model_path", ""),
                    "checkpoints": detail.get("checkpoints", []),
                    "public": detail.get("public_checkpoints", []),
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'JOB':<20} {'AGENT':<12} {'STATE':<10} {'LATEST VERSION':<44} CHECKPOINTS")
    for r in rows:
        names = ", ".join(f"{n} (public)" if n in r["public"] else n for n in r["checkpoints"]) or "-"
        print(f"{r['job_id']:<20} {r['agent']:<12} {r['state']:<10} {r['latest'] or '-':<44} {names}")
    return 0


def _audit(args: argparse.Namespace) -> int:
    with _client(args) as client:
        log = client.audit_log(args.day, args.event_type)
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in log.entries], indent=2))
        return 0
    print(f"{'TIME (UTC)':<20} {'EVENT':<22} {'TENANT':<14} {'OWNER':<14} {'PATH':<48} DETAILS")
    for e in log.entries:
        when = datetime.fromtimestamp(e.time_s, UTC).strftime("%Y-%m-%d %H:%M:%S")
        details = ", ".join(f"{k}={v}" for k, v in sorted(e.details.items()))
        print(f"{when:<20} {e.event:<22} {e.tenant:<14} {e.owner:<14} {e.path:<48} {details}")
    if log.truncated:
        print(f"(the first {len(log.entries)} entries of the day only)")
    return 0


def _usage(args: argparse.Namespace) -> int:
    end = time.time()
    with _client(args) as client:
        used = client.usage(end - args.hours * 3600.0, end)
        held = client.storage_usage()
    if args.json:
        rows = [dataclasses.asdict(u) for u in used.rows]
        print(json.dumps({"usage": rows, "storage": dataclasses.asdict(held)}, indent=2))
        return 0
    print(f"{'HOUR (UTC)':<17} {'KIND':<17} {'BASE MODEL':<28} {'JOB':<22} COUNT")
    for u in used.rows:
        hour = datetime.fromtimestamp(u.bucket_s, UTC).strftime("%Y-%m-%d %H:00")
        print(f"{hour:<17} {u.kind:<17} {u.base_model:<28} {u.job_id or '-':<22} {u.count}")
    print(f"now: {held.checkpoint_count} named checkpoints, {held.size_bytes / 1e6:.1f} MB on the scheduler's disk")
    return 0


def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.runtime_status()
    if args.json:
        print(json.dumps({k: status.get(k) for k in ("base_model", "actors", "workers")}, indent=2))
        return 0
    print(f"base model {status.get('base_model', '')}")
    actors = status.get("actors") or []
    if actors:
        print(f"{'ACTOR':<20} {'STATE':<8} {'PID':>8} {'RESTARTS':>8} {'LAST EXIT':>9}  NODE")
    for a in actors:
        state = "gave-up" if a["gave_up"] else ("alive" if a["alive"] else "down")
        code = "-" if a["last_exit_code"] is None else str(a["last_exit_code"])
        pid = str(a["pid"]) if a["pid"] else "-"
        node = a.get("node") or "this machine"  # a Ray-placed worker: IP/NODE_ID
        print(f"{a['name']:<20} {state:<8} {pid:>8} {a['restarts']:>8} {code:>9}  {node}")
    if not actors:
        print("(no supervised actors: this scheduler was not started by a local runtime)")
    print(f"{'WORKER':<20} {'ROLE':<8} {'ALIVE':<6} {'SEEN':>6}  ADDRESS")
    for w in status.get("workers") or []:
        alive = "yes" if w["alive"] else "no"
        # A learner that does not see the runtime's state_dir: its checkpoints stay on its machine.
        own = "  (own state_dir)" if w["role"] == "learner" and not w.get("shares_state", True) else ""
        print(f"{w['worker_id']:<20} {w['role']:<8} {alive:<6} {w['seen_s_ago']:>5.1f}s  {w['address']}{own}")
    return 0


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", help="scheduler address (default $POLYTINKER_SCHEDULER)")
    p.add_argument("--api-key", help="API key (default $POLYTINKER_API_KEY)")
    p.add_argument("--curve-secret", help="your Curve .key_secret, for a scheduler that serves with Curve")
    p.add_argument("--scheduler-key", help="the scheduler's Curve .key (public) file")


def register(sub: Any) -> None:
    """The client's subcommands, in the order ``polytinker --help`` lists them."""
    _add_jobs_parser(sub)
    _add_checkpoints_parser(sub)
    _add_audit_parser(sub)
    _add_usage_parser(sub)
    _add_status_parser(sub)


def _add_jobs_parser(sub: Any) -> None:
    """``jobs list|show|cancel|pause|resume``."""
    j = sub.add_parser("jobs", help="list, show, cancel, pause and resume this tenant's jobs")
    _add_client_args(j)
    jobs_sub = j.add_subparsers(dest="jobs_command", metavar="JOBS_COMMAND", required=True)
    ls = jobs_sub.add_parser("list", help="this tenant's jobs")
    ls.add_argument("--live", action="store_true", help="only queued, running and paused jobs")
    ls.add_argument("--json", action="store_true", help="print JSON")
    for name in ("show", "cancel", "pause", "resume"):
        c = jobs_sub.add_parser(name, help=f"{name} one job")
        c.add_argument("job_id")
    j.set_defaults(func=_jobs)


def _add_checkpoints_parser(sub: Any) -> None:
    """``checkpoints list|export (download)|delete|publish|unpublish``."""
    ck = sub.add_parser(
        "checkpoints", help="list this tenant's saved versions and checkpoints; export, delete or publish one"
    )
    _add_client_args(ck)
    ck_sub = ck.add_subparsers(dest="checkpoints_command", metavar="CHECKPOINTS_COMMAND", required=True)
    ck_ls = ck_sub.add_parser("list", help="each training job's latest version and its named checkpoints")
    ck_ls.add_argument("--json", action="store_true", help="print JSON")
    ex = ck_sub.add_parser(
        "export",
        aliases=["download"],
        help="write saved weights (a version or a save_state checkpoint) as a peft adapter (or merged model) directory",
    )
    ex.add_argument(
        "model_path",
        help="a version (polytinker://JOB/AGENT@VERSION, tinker://JOB/sampler_weights/AGENT@VERSION) or a"
        " checkpoint (polytinker-ckpt://JOB/NAME, tinker://JOB/weights/NAME)",
    )
    ex.add_argument("--out", required=True, help="the directory to write (must not exist unless --overwrite)")
    ex.add_argument("--merged", action="store_true", help="a whole Hugging Face model with the adapter merged in")
    ex.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    rm = ck_sub.add_parser("delete", help="delete a job's named checkpoint (as list names it) and its files")
    rm.add_argument("job_id")
    rm.add_argument("name", help="a save_state name, or sampler-NAME for a named save_weights_for_sampler")
    for verb, what in (("publish", "let every tenant read"), ("unpublish", "make this tenant's alone again")):
        pub = ck_sub.add_parser(verb, help=f"{what} a job's named checkpoint (as list names it)")
        pub.add_argument("job_id")
        pub.add_argument("name", help="a save_state name, or sampler-NAME for a named save_weights_for_sampler")
    ck.set_defaults(func=_checkpoints)


def _add_audit_parser(sub: Any) -> None:
    """``audit``: the tenant's audit log of one day."""
    au = sub.add_parser("audit", help="this tenant's audit log: who created, read, deleted or published its weights")
    _add_client_args(au)
    au.add_argument("--day", help="the UTC day, YYYY-MM-DD (default today)")
    au.add_argument("--event-type", default="all", choices=AUDIT_EVENT_TYPES, help="which resource's events")
    au.add_argument("--json", action="store_true", help="print JSON")
    au.set_defaults(func=_audit)


def _add_usage_parser(sub: Any) -> None:
    """``usage``: the tenant's tokens and saves by the hour, and its checkpoint storage now."""
    us = sub.add_parser("usage", help="this tenant's tokens trained and sampled, and saves, by the hour; storage now")
    _add_client_args(us)
    us.add_argument("--hours", type=float, default=24.0, help="how many hours back (default 24; at most 336)")
    us.add_argument("--json", action="store_true", help="print JSON")
    us.set_defaults(func=_usage)


def _add_status_parser(sub: Any) -> None:
    """``status``: the runtime's actors and workers."""
    st = sub.add_parser("status", help="the runtime's actors (alive, pid, restarts, last exit) and workers")
    _add_client_args(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=_status)


__all__ = ["register"]
