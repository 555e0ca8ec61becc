"""What must hold when a simulated job ends (the per-step checks live in sim/oracle.py and in
World: records applied at most once, the PS's own counts, one acting leader, no livelock, an
end within the progress bound once faults stop).
"""

from __future__ import annotations


def at_the_end(world) -> None:
    """Every record of every epoch applied once on every shard (or possibly missing where a PS
    restarted without a checkpoint); in sync mode every shard at one version."""
    master = world.master
    trained_epochs = master.tasks.epoch + 1
    world.oracle.check_complete(world.epochs, world.records, trained_epochs)
    if trained_epochs < world.epochs:
        world.violation(f"the job finished after {trained_epochs} of {world.epochs} epochs")
    versions = [ps.core.shard.version for ps in master.shard_servers(lenient=True) if hasattr(ps, "core")]
    if not world.mode.use_async and len(set(versions)) > 1:
        world.violation(f"sync shards ended at different versions {versions}")
    if master.evaluation is not None:
        if not master.evaluation.results:
            world.violation("the job ended without an evaluation")
        for result in master.evaluation.results:
            if result.records != world.val_records:
                world.violation(f"evaluation round {result.round_id} ({result.reason}) counted {result.records} "
                                f"records, the validation data has {world.val_records}")
    done = sum(e.records_done for e in master.tasks.epochs)
    expected = world.records * world.epochs
    if done != expected:
        world.violation(f"the ledger counts {done} records done, the job has {expected}")
    replicas_held(world)
    if world.topic is not None:
        stream_consumed(world)


def replicas_held(world) -> None:
    """--ps_replicas: a single PS death (and no other fault of a PS or the master) rolls nothing
    back and trains no record twice: its shards go on from their backups."""
    mode, nemesis = world.mode, world.nemesis
    if not mode.ps_replicas or nemesis.ps_kills != 1 or nemesis.ps_freezes or world.masters_started != 1:
        return
    if world.rollbacks:
        world.violation(f"one PS died with --ps_replicas {mode.ps_replicas}, and {world.rollbacks} PS went back to "
                        f"a checkpoint or started over")
    retrained = sum(e.retrained.get(cause, 0) for e in world.master.tasks.epochs for cause in ("rollback", "start over"))
    if retrained:
        world.violation(f"one PS died with --ps_replicas {mode.ps_replicas}, and {retrained} records were trained again")


def stream_consumed(world) -> None:
    """A stream job consumed every record that arrived (each partition cut to its end), once."""
    topic, cut = world.topic, world.master.tasks.offsets()
    for partition in topic.partition_ids():
        produced, consumed = topic.end(partition), cut.get(topic.address.partition_path(partition), 0)
        if consumed != produced:
            world.violation(f"partition {partition} holds {produced} records, the job consumed {consumed}")
