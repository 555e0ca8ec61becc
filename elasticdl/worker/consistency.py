"""ConsistencyPolicy: the worker's half of sync, async and stale-synchronous training.

The worker tells the policy what happened (a pull, the answers to a push, a batch pushed, a
task started, an evaluation snapshot loaded, a parameter server reconnected) and asks it what
to do next: must it pull before this batch, which PS must make the pull wait for an update,
must it wait for slower workers, which PS must get the gradient again. The policy holds the
state those rules need (the version held of each PS, the clock, ...) and does no I/O.

Three modes, from the job's flags (docs/consistency.md):

- sync (default): pull before every batch. A PS whose part of the model is small answers a
  push that made a new version with that version's parameters; that answer stands in for
  the pull of the next batch of the same task only (while the worker fetches a task, the
  others may push many versions, and a gradient on those would be refused as stale). After
  a push the PS accepted but has not applied yet (it waits for the others' gradients), the
  next pull from that PS waits until the model moves, so each version averages one gradient
  per worker; not with --sync_version_tolerance. A gradient refused as stale is computed
  again on freshly pulled parameters and pushed again to the PS that refused it.
- async (--use_async): pull every ``get_model_steps`` batches; in between the worker applies
  its own gradients to its local copy. Pushes are not answered with parameters: the shorter
  loop doubled the mean staleness and cost accuracy (docs/consistency.md).
- accumulated pushes (--use_async --push_steps n): the worker pushes the mean of the gradients
  of n batches at once (worker/accumulation.py), applying each batch's to its own copy in
  between. It pulls only right after such a push: a pull in the middle would throw away the
  local updates of gradients not pushed yet. With --get_model_steps m it pulls after the
  first push at or past m batches since the last pull (m = 1: after every push).
- stale-synchronous parallel (--use_async --staleness_bound s): as async, and a worker waits
  while its clock (batches pushed) is more than ``s`` ahead of the slowest worker that holds
  a task. Workers without a task (dead, preempted, idle) never hold others back.
- communication overlapped with compute (--use_async --overlap_communication): a batch's push,
  and the pull after it, run on a background thread while the next batch computes
  (worker/overlap.py), on the worker's own copy with the last batch's gradients applied locally.
  At most one such exchange is in flight; the batch computed meanwhile has the update of the
  one in flight only from that local step, not from the PS, so in SSP the exchange counts as
  one version of lag besides its batch: the worker waits while
  ``clock + 2 * in_flight - slowest > s``, and when it must wait it first settles the
  exchange, then waits, then pulls (as without overlap).

After an evaluation snapshot was loaded, the next training batch pulls first; after a PS
reconnected (it may come back older, from a checkpoint, or empty), the next pull asks every
PS for all of its parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from elasticdl.errors import JobFailure
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.worker.batch_steps import MAX_PUSH_TRIES, BatchSteps
from elasticdl.worker.steps import PullRequest

__all__ = ["ConsistencyPolicy", "PullRequest", "PushRejectedError", "TaskTakenBackError"]

if TYPE_CHECKING:
    from elasticdl.rpc.ps_client import PushAnswer


class PushRejectedError(JobFailure, RuntimeError):
    """A PS refused a gradient for a reason other than staleness: computing it again cannot help."""


class TaskTakenBackError(RuntimeError):
    """The master took the task back (its hand-out was fenced on the PS): leave it, take the next."""


class ConsistencyPolicy(BatchSteps):
    """The worker-side consistency rule and its state (the architecture's ``StalenessStrategy``).

    The worker (or a simulator) drives a batch by asking ``next_step()`` and telling what
    happened, until the step is DONE; ``task_ending()`` then flushes a task (worker/steps.py,
    worker/batch_steps.py). A numpy stand-in, async with 1 PS:

    >>> from elasticdl.rpc.ps_client import PushAnswer
    >>> from elasticdl.worker.steps import StepKind
    >>> policy = ConsistencyPolicy(use_async=True)
    >>> policy.pulled(policy.pull_request(everything=True), [0])  # the first pull
    []
    >>> done = []
    >>> for batch in range(2):
    ...     policy.batch_started()
    ...     while (step := policy.next_step()).kind is not StepKind.DONE:
    ...         done.append(step.kind.value)
    ...         if step.kind is StepKind.PULL:
    ...             _ = policy.pulled(step.pull, [batch])
    ...         elif step.kind is StepKind.COMPUTE:
    ...             policy.computed(finite=True)
    ...         elif step.kind is StepKind.PUSH:
    ...             _ = policy.pushed({0: PushAnswer(PushOutcome.APPLIED, batch + 1)}, step)
    >>> done
    ['compute', 'push', 'pull', 'compute', 'push']
    >>> policy.task_ending(); policy.next_step().kind.value
    'done'

    The rules underneath, asked and told one by one:

    >>> policy = ConsistencyPolicy(use_async=True, get_model_steps=2)
    >>> policy.pulled(policy.pull_request(), [5])  # no PS was waited for in vain
    []
    >>> policy.batch_pushed()
    >>> policy.must_pull(), policy.model_version
    (False, 5)
    >>> policy.batch_pushed()
    >>> policy.must_pull()
    True
    """

    def __init__(
        self,
        use_async: bool = False,
        staleness_bound: int = 0,
        get_model_steps: int = 1,
        sync_version_tolerance: int = 0,
        num_ps: int = 1,
        push_steps: int = 1,
        overlap: bool = False,
        max_push_tries: int = MAX_PUSH_TRIES,
    ):
        self._init_steps(max_push_tries)
        if num_ps < 1:
            raise ValueError(f"num_ps must be at least 1. Received: num_ps={num_ps}")
        if get_model_steps < 1:
            raise ValueError(f"get_model_steps must be at least 1. Received: get_model_steps={get_model_steps}")
        if push_steps < 1 or (push_steps > 1 and not use_async):
            raise ValueError(f"push_steps must be at least 1, and 1 in sync mode. Received: push_steps={push_steps}")
        if overlap and not use_async:
            raise ValueError("overlap needs use_async. Received: use_async=False")
        # Push, and pull after it, while the next batch computes (worker/overlap.py). Not an
        # accumulated push (the job's flags refuse both together).
        self.overlap = overlap and push_steps == 1
        self.push_steps = push_steps
        self.use_async = use_async
        self.staleness_bound = staleness_bound
        self.get_model_steps = get_model_steps
        self.sync_version_tolerance = sync_version_tolerance
        self.num_ps = num_ps
        self._versions = [-1] * num_ps  # the version held of each PS's shard (-1: none yet)
        # Per PS: our last push was accepted but not applied yet (strict sync): wait for the update.
        self._awaiting_update = [False] * num_ps
        # Every PS answered our last push with the version it made: we hold the latest model.
        self._fresh_from_push = False
        # A PS refused our gradient as stale: pull before computing it again.
        self._stale = False
        # A PS reconnected (or the model was rolled back): what is held may be newer than the PS,
        # and the versions are forgotten (-1, which every PS refuses): pull before the next
        # compute or push, in every mode, whatever is accumulated or in flight.
        self._refresh = False
        self.steps_since_pull = 0  # batches pushed since the last pull (async)
        self.clock = 0  # batches pushed (stale-synchronous parallel)
        self.unpushed = 0  # batches trained and applied locally, their gradients not pushed yet
        self.in_flight = 0  # exchanges (push, then maybe pull) running in the background: 0 or 1

    @classmethod
    def from_config(cls, config, num_ps: int) -> ConsistencyPolicy:
        return cls(
            use_async=config.consistency.use_async,
            staleness_bound=config.consistency.staleness_bound,
            get_model_steps=config.consistency.get_model_steps,
            sync_version_tolerance=config.consistency.sync_version_tolerance,
            num_ps=num_ps,
            push_steps=config.consistency.push_steps,
            overlap=config.consistency.overlap_communication,
        )

    # ------------------------------------------------------------ the mode

    @property
    def bounded(self) -> bool:
        """Stale-synchronous parallel: report the clock before each batch (``must_wait``)."""
        return self.use_async and self.staleness_bound > 0

    @property
    def applies_locally(self) -> bool:
        """Async workers that pull (or push) rarely keep training on their own updates in between;
        with overlap, the next batch computes before the exchange in flight returns the model
        with this batch's update, so it computes on the worker's own copy of that update."""
        return self.use_async and (self.get_model_steps > 1 or self.push_steps > 1 or self.overlap)

    @property
    def accumulates(self) -> bool:
        """Push the mean of every ``push_steps`` batches' gradients (worker/accumulation.py)."""
        return self.push_steps > 1

    def push_due(self) -> bool:
        """Enough batches were accumulated: push their sum now."""
        return self.unpushed >= self.push_steps

    @property
    def waits_for_version(self) -> bool:
        """Strict sync: after a pending push, the next pull waits until the model moves."""
        return not self.use_async and self.sync_version_tolerance == 0

    @property
    def wants_push_parameters(self) -> bool:
        """Ask a push to answer with the parameters of the version it made?

        A sync worker pulls before its next batch anyway: it takes the new parameters in the
        push's answer instead, one call less per batch for small models. Not async: there the
        shorter loop doubles the mean staleness (0.25-0.5 against 0.03-0.3 on digits, 2 workers,
        SSP-2), and 1 of 8 such runs ended at 0.83 accuracy (pulls: >= 0.93).
        """
        return not self.use_async

    # ------------------------------------------------------------ what the worker holds

    @property
    def versions(self) -> list[int]:
        """The version held of each PS's shard (sent with pulls and pushes); -1: none."""
        return list(self._versions)

    @property
    def model_version(self) -> int:
        return max(self._versions)

    # ------------------------------------------------------------ decisions

    def must_pull(self) -> bool:
        """Before computing a batch's gradients: pull first?"""
        if self._stale or self._refresh:
            return True
        if self._fresh_from_push or self.unpushed or self.in_flight:
            return False  # an exchange in flight pulls if one is due: the batch computes on what is held
        return not self.use_async or self.steps_since_pull >= self.get_model_steps

    def must_pull_before_push(self) -> bool:
        """Before pushing gradients already computed (accumulated, or retried after a PS came
        back): pull first? Only after a reconnect, when the versions held are forgotten."""
        return self._refresh

    def pulls_after_push(self) -> bool:
        """Overlap: should the exchange about to start pull after its push? As often as the
        worker would pull before a batch without overlap (every ``get_model_steps`` pushes)."""
        return self.steps_since_pull + 1 >= self.get_model_steps

    def pull_request(self, everything: bool = False) -> PullRequest:
        """The pull to make; with ``everything``, every PS sends all its parameters."""
        versions = [-1] * self.num_ps if everything else self._versions
        return PullRequest(tuple(versions), tuple(self._awaiting_update))

    def must_wait(self, clock: int, slowest_clock: int) -> bool:
        """SSP: this worker's clock (as the master counts it) is too far ahead of the slowest."""
        # The batch of an exchange in flight is not in the clock yet, and the batch about to be
        # computed misses its update: one version of lag each (both 0 without overlap).
        return self.bounded and clock + 2 * self.in_flight - slowest_clock > self.staleness_bound

    # ------------------------------------------------------------ events

    def pulled(self, request: PullRequest, versions: Sequence[int]) -> list[int]:
        """The pull of ``request`` answered with these versions (every PS holds a model).

        Returns the PS that were waited for but did not move (their timeout passed): the
        worker computes on the same version again.
        """
        stalled = [
            ps for ps, version in enumerate(versions)
            if request.wait_for_newer[ps] and version == request.versions[ps]
        ]
        self._versions = list(versions)
        self._awaiting_update = [False] * self.num_ps
        self._fresh_from_push = False
        self._stale = False
        self._refresh = False
        self._batch_pulled = True
        self.steps_since_pull = 0
        return stalled

    def push_answered(self, answers: Mapping[int, PushAnswer]) -> set[int]:
        """The answers of the PS a batch's gradients went to; returns the PS to push again to.

        Those refused the gradient as stale: pull (``must_pull`` says so) and compute it again.
        Any other refusal raises PushRejectedError. An answer carrying parameters moves the
        version held of its PS to the answer's (the worker loads them).
        """
        retry = set()
        refused = []
        fenced = [ps for ps, answer in answers.items() if answer.outcome is PushOutcome.REJECTED_FENCED]
        if fenced:
            # The master took the task back (rolled back to a checkpoint, or requeued it): the
            # model may have gone back too, so everything is pulled again before the next task.
            self.ps_reconnected()
            raise TaskTakenBackError(answers[fenced[0]].reason or "the task's hand-out was fenced")
        for ps, answer in answers.items():
            outcome = answer.outcome
            if outcome.accepted:
                self._awaiting_update[ps] = self.waits_for_version and not outcome.applied
            elif outcome is PushOutcome.REJECTED_STALE:
                retry.add(ps)
            else:
                refused.append((ps, answer))
        if refused:
            ps, answer = refused[0]
            raise PushRejectedError(
                f"PS {ps} rejected the gradients ({answer.outcome.name}): {answer.reason or 'no reason given'}"
            )
        fresh = [ps for ps, answer in answers.items() if answer.params is not None]
        for ps in fresh:
            self._versions[ps] = answers[ps].version
        self._fresh_from_push = len(fresh) == self.num_ps
        self._stale = bool(retry)
        return retry

    def batch_pushed(self) -> None:
        """Every PS accepted the batch's gradients."""
        self.clock += 1
        self.steps_since_pull += 1

    def exchange_started(self) -> None:
        """Overlap: a batch's push (and the pull after it, if due) runs in the background."""
        if self.in_flight:
            raise RuntimeError("an exchange is already in flight: settle it before starting the next")
        self.in_flight = 1

    def exchange_settled(self) -> None:
        """Overlap: the exchange in flight ended (its answers are taken next: ``push_answered``,
        ``batch_pushed``, ``pulled``)."""
        self.in_flight = 0

    def exchange_dropped(self) -> None:
        """Overlap: the exchange in flight was left (its task failed or was taken back): the
        next batch pulls."""
        self.in_flight = 0
        self.steps_since_pull = self.get_model_steps

    def held_back(self) -> None:
        """Overlap in SSP: the worker waited for the slowest; the parameters pulled before that
        may miss what it pushed since, so the next batch pulls (as it would without overlap)."""
        if self.overlap:
            self.steps_since_pull = self.get_model_steps

    def batch_accumulated(self) -> None:
        """A batch's gradients were applied locally and kept to be pushed with the next ones."""
        self.clock += 1
        self.steps_since_pull += 1
        self.unpushed += 1

    def accumulation_pushed(self) -> None:
        """Every PS accepted the accumulated gradients: the next batch may pull."""
        self.unpushed = 0

    def accumulation_dropped(self) -> None:
        """The accumulated gradients were dropped (their task was taken back): the local copy
        holds updates the PS never got, so the next batch pulls."""
        self.unpushed = 0
        self.steps_since_pull = self.get_model_steps

    def task_started(self) -> None:
        """A push's answer stands in for the pull of the batch right after it, not of a batch
        after a gap: between two tasks the other workers may push many versions."""
        self._fresh_from_push = False
        self._flushing = False

    def snapshot_loaded(self) -> None:
        """An evaluation loaded a snapshot's parameters: the next training batch pulls first."""
        self._versions = [-1] * self.num_ps
        self._fresh_from_push = False
        self._refresh = True  # whatever is accumulated or in flight: versions -1 are refused
        self.steps_since_pull = self.get_model_steps

    def ps_reconnected(self) -> None:
        """A PS was unreachable and came back, maybe older (from a checkpoint) or empty:
        the next pull asks every PS for everything, and waits for none. ``must_pull`` is True
        until then in every mode: a gradient pushed before that pull would carry version -1,
        which every PS refuses (async and SSP jobs failed on a PS kill that way)."""
        self._versions = [-1] * self.num_ps
        self._awaiting_update = [False] * self.num_ps
        self._fresh_from_push = False
        self._stale = False
        self._refresh = True
        self._forget_unsent()
