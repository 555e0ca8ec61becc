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
    versions = [ps.core.shard.version for ps in world.ps if ps is not None and ps.alive]
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
