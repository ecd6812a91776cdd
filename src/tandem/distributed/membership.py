"""The machines a job runs on, kept with each checkpoint, and the line a change of them says.

Under ``tandem launch --nnodes MIN:MAX`` a node that joins or leaves makes torchrun restart
every worker; the run continues from rank 0's last checkpoint, its global batch, schedule and
data order untouched (the shares are cut again over the new processes). Rank 0 says what
differs in one line, with its cost: the steps completed after that checkpoint, made again.
"""

from __future__ import annotations


def of(agreement) -> dict:
    """This job's machines (addresses towards the master) and processes, as kept in a checkpoint."""
    nodes = sorted({addr for _, addr in agreement.peers.values() if addr})
    return {"nodes": nodes, "processes": agreement.world_size}


def completed_steps(agreement, completed: int | None) -> int | None:
    """The last step any rank's node saw completed before the workers last ended (each node's
    launcher file keeps it; ``None``: no node knows). A collective: every rank calls it."""
    known = [c for c in agreement.each(completed) if c is not None]
    return max(known) if known else None


def change_line(before: dict | None, now: dict, step: int, completed: int | None) -> str | None:
    """``node 192.0.2.3 joined: 3 nodes, 3 processes; continuing from step 12 ...``, or None
    when the machines and processes are those that saved the checkpoint (or it does not say)."""
    if not isinstance(before, dict) or not before.get("nodes"):
        return None
    was, are = list(before["nodes"]), list(now["nodes"])
    if was == are and before.get("processes") == now["processes"]:
        return None
    moves = [_named([a for a in are if a not in was], "joined"),
             _named([a for a in was if a not in are], "left")]
    moved = ", ".join(m for m in moves if m) or (
        f"{before.get('processes')} processes became {now['processes']}")
    count = len(are)
    line = (f"{moved}: {count} node{'s' if count != 1 else ''}, {now['processes']} process"
            f"{'es' if now['processes'] != 1 else ''}; continuing from step {step}")
    if completed is None:
        return line + ", the last checkpoint"
    lost = max(0, completed - step)
    return line + (" (the change cost no completed step)" if not lost else
                   f" (the change cost {lost} completed step{'s' if lost != 1 else ''}: "
                   f"{step + 1}-{completed} run again; --save-every bounds it)")


def _named(addrs: list[str], verb: str) -> str:
    if not addrs:
        return ""
    return f"node{'s' if len(addrs) > 1 else ''} {', '.join(addrs)} {verb}"
