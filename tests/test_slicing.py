"""Large dense variables sliced by rows across the PS (elasticdl/model/slicing.py): names,
placement, cutting and joining, and checkpoints restored on another number of PS."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticdl.config import JobConfig
from elasticdl.model import checkpoint
from elasticdl.model.checkpoint_integrity import DamagedCheckpointError
from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.model.sharding import ps_for_variable
from elasticdl.model.slicing import (
    DEFAULT_SLICE_ABOVE_MB,
    DenseSlicing,
    SliceError,
    SliceName,
    clipnorm_problem,
    held_variables,
    join,
    parse_slice_name,
    row_range,
    sliced_names,
    with_slices_joined,
)
from elasticdl.ps.server import ParameterServer, PSSettings

OPTIMIZERS = {
    "sgd": OptimizerSpec("SGD", {"learning_rate": 0.1}),
    "momentum": OptimizerSpec("SGD", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}),
    "adam": OptimizerSpec("Adam", {"learning_rate": 0.01}),
    "adagrad": OptimizerSpec("Adagrad", {"learning_rate": 0.1}),
}


@given(rows=st.integers(0, 500), count=st.integers(1, 9))
def test_row_ranges_cover_every_row_once_and_differ_by_at_most_one(rows, count):
    ranges = [row_range(rows, k, count) for k in range(count)]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert ranges == [(s[0], s[-1] + 1) if len(s) else (ranges[k][0], ranges[k][0])
                      for k, s in enumerate(np.array_split(np.arange(rows), count))]


def test_slice_names_parse_back_and_place_slice_k_on_ps_k():
    name = str(SliceName("dense_1/kernel", 2, 3))
    assert name == "dense_1/kernel#slice-2-of-3"
    assert parse_slice_name(name) == SliceName("dense_1/kernel", 2, 3)
    assert parse_slice_name("dense_1/kernel") is None
    assert parse_slice_name("w#slice-2-of-2") is None and parse_slice_name("w#slice-0-of-0") is None
    assert [ps_for_variable(str(SliceName("w", k, 3)), 3) for k in range(3)] == [0, 1, 2]
    assert held_variables(["w#slice-0-of-2", "w#slice-1-of-2", "b"]) == {"w", "b"}


def test_only_variables_above_the_threshold_with_enough_rows_are_sliced():
    slicing = DenseSlicing.from_flag(1.0, 3)  # 1 MiB
    assert slicing.count((1024, 257), 1024 * 257 * 4) == 3
    assert slicing.count((1024, 256), 1024 * 256 * 4) == 1  # exactly 1 MiB: not above
    assert slicing.count((2, 1 << 20), 8 << 20) == 1  # fewer rows than PS
    assert slicing.count((), 4) == 1
    assert DenseSlicing.from_flag(-1, 3).count((1 << 20, 8), 32 << 20) == 1  # negative: never
    assert DenseSlicing.from_flag(0, 1).count((1 << 20, 8), 32 << 20) == 1  # one PS: nothing to slice
    assert DenseSlicing.from_flag(0, 2).count((2,), 8) == 2


def test_pieces_are_row_views_and_non_trainable_changes_are_cut_alike():
    slicing = DenseSlicing.from_flag(0, 2)
    kernel = np.arange(15, dtype=np.float32).reshape(5, 3)
    parts = slicing.split({"k": kernel, "bn/moving_mean": NonTrainableChange(np.arange(4.0, dtype=np.float32)),
                           "s": np.float32(1.0)})
    assert sorted(parts) == ["bn/moving_mean#slice-0-of-2", "bn/moving_mean#slice-1-of-2",
                             "k#slice-0-of-2", "k#slice-1-of-2", "s"]
    assert np.shares_memory(parts["k#slice-0-of-2"], kernel)  # no copy on the way out
    np.testing.assert_array_equal(parts["k#slice-1-of-2"], kernel[3:])
    change = parts["bn/moving_mean#slice-1-of-2"]
    assert isinstance(change, NonTrainableChange)
    np.testing.assert_array_equal(change.values, [2.0, 3.0])
    assert sliced_names(["bn/moving_mean"], [parts]) == ["bn/moving_mean#slice-0-of-2",
                                                         "bn/moving_mean#slice-1-of-2"]


def test_join_refuses_a_missing_slice_or_mixed_cuts():
    rows = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(join("w", {0: (2, rows), 1: (2, rows * 2)})[2:], rows * 2)
    with pytest.raises(SliceError, match=r"slices \[1\] of 2 are missing"):
        join("w", {0: (2, rows)})
    with pytest.raises(SliceError, match="different cuts"):
        join("w", {0: (2, rows), 1: (3, rows)})


def test_the_flag_default_is_the_modules():
    assert JobConfig().training.slice_dense_above_mb == DEFAULT_SLICE_ABOVE_MB


# ---------------------------------------------------------------- the PS: sliced == whole


def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"kernel": rng.normal(size=(7, 5)).astype(np.float32), "bias": rng.normal(size=5).astype(np.float32),
            "scale": np.float32(rng.normal())}


def _cores(spec: OptimizerSpec, num_ps: int, slicing: DenseSlicing, model, **settings) -> list[ParameterServer]:
    cores = [ParameterServer(PSSettings(ps_id=i, num_ps=num_ps, **settings), make_optimizer(spec))
             for i in range(num_ps)]
    for core in cores:
        mine = {n: v for n, v in slicing.split(model).items() if ps_for_variable(n, num_ps) == core.settings.ps_id}
        core.push_model(mine)
    return cores


def _push(cores, slicing: DenseSlicing, grads) -> None:
    parts = slicing.split(grads)
    for core in cores:
        mine = {n: v for n, v in parts.items() if ps_for_variable(n, len(cores)) == core.settings.ps_id}
        assert core.push_gradients(mine, core.shard.version, None).accepted


def _whole(cores) -> dict[str, np.ndarray]:
    slices: dict[str, dict] = {}
    for core in cores:
        for name, value in core.shard.params.items():
            parsed = parse_slice_name(name)
            key, index, count = (name, 0, 1) if parsed is None else (parsed.whole, parsed.index, parsed.count)
            slices.setdefault(key, {})[index] = (count, value)
    return {name: join(name, parts) for name, parts in slices.items()}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sliced_ps_cores_update_bit_for_bit_as_whole_ones(optimizer):
    """Three PS, every variable with enough rows sliced, against the same three PS holding
    whole variables: after 6 steps (2 gradients averaged per version) every value is equal."""
    spec, model = OPTIMIZERS[optimizer], _model(0)
    whole_layout, sliced_layout = DenseSlicing.from_flag(-1, 3), DenseSlicing.from_flag(0, 3)
    whole = _cores(spec, 3, whole_layout, model, grads_to_wait=2)
    sliced = _cores(spec, 3, sliced_layout, model, grads_to_wait=2)
    assert all(len(core.shard.params) >= 2 for core in sliced)  # a slice of each of kernel and bias
    rng = np.random.default_rng(1)
    for _ in range(12):
        grads = {n: rng.normal(size=np.shape(v)).astype(np.float32) for n, v in model.items()}
        _push(whole, whole_layout, grads)
        _push(sliced, sliced_layout, grads)
    assert {c.shard.version for c in whole + sliced} == {6}
    expected, got = _whole(whole), _whole(sliced)
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
        assert not np.array_equal(got[name], model[name])  # trained


# ---------------------------------------------------------------- checkpoints: cut again


def _save_cut(directory: str, cores) -> None:
    for core in cores:
        checkpoint.save_shard(directory, core.settings.ps_id, len(cores), core._copy_locked())


@pytest.mark.parametrize("new_num_ps", [1, 2, 3, 4])
def test_a_sliced_checkpoint_restores_on_another_number_of_ps(tmp_path, new_num_ps):
    """Saved by 3 PS with slices; restored on 1 to 4 PS: params and slots are cut again for the
    new count (kernel and bias sliced, the scalar whole), and joined they equal the saved ones."""
    spec = OPTIMIZERS["adam"]
    layout = DenseSlicing.from_flag(0, 3)
    cores = _cores(spec, 3, layout, _model(0), grads_to_wait=1)
    rng = np.random.default_rng(2)
    for _ in range(3):
        _push(cores, layout, {n: rng.normal(size=np.shape(v)).astype(np.float32) for n, v in _model(0).items()})
    _save_cut(str(tmp_path), cores)
    saved = _whole(cores)
    saved_slots = {slot: _join_slots(cores, slot) for slot in ("momentum", "velocity")}

    new_layout = DenseSlicing.from_flag(0, new_num_ps)
    restored = [ParameterServer(PSSettings(ps_id=i, num_ps=new_num_ps, checkpoint_dir_for_init=str(tmp_path),
                                           slice_dense_above_mb=0), make_optimizer(spec))
                for i in range(new_num_ps)]
    for core in restored:
        core.restore()
    for core in restored:
        for name in core.shard.params:
            assert ps_for_variable(name, new_num_ps) == core.settings.ps_id
            if new_num_ps > 1 and name != "scale":
                assert parse_slice_name(name).count == new_num_ps
    got = _whole(restored)
    for name, value in saved.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    for slot, expected in saved_slots.items():
        for name, value in expected.items():
            np.testing.assert_array_equal(_join_slots(restored, slot)[name], value, err_msg=f"{slot}:{name}")
    # Training goes on from there as the saved job would.
    assert {core.shard.step for core in restored} == {3}
    assert new_layout.count((7, 5), 140) == (1 if new_num_ps == 1 else new_num_ps)


def _join_slots(cores, slot: str) -> dict[str, np.ndarray]:
    slices: dict[str, dict] = {}
    for core in cores:
        for name, slots in core.shard.slots.items():
            parsed = parse_slice_name(name)
            key, index, count = (name, 0, 1) if parsed is None else (parsed.whole, parsed.index, parsed.count)
            slices.setdefault(key, {})[index] = (count, slots[slot])
    return {name: join(name, parts) for name, parts in slices.items()}


def test_a_whole_checkpoint_is_sliced_when_the_threshold_says_so_and_back(tmp_path):
    spec = OPTIMIZERS["momentum"]
    whole = _cores(spec, 2, DenseSlicing.from_flag(-1, 2), _model(3))
    _save_cut(str(tmp_path / "whole"), whole)
    held = {}
    for ps_id in range(2):
        state = checkpoint.load_shard(str(tmp_path / "whole"), ps_id, 2, DenseSlicing.from_flag(0, 2))
        held[ps_id] = sorted(state.params)
        assert sorted(state.slots) == sorted(n for n in state.params)
    assert held[0][:2] == ["bias#slice-0-of-2", "kernel#slice-0-of-2"]
    assert held[1][:2] == ["bias#slice-1-of-2", "kernel#slice-1-of-2"]

    sliced = _cores(spec, 2, DenseSlicing.from_flag(0, 2), _model(3))
    _save_cut(str(tmp_path / "sliced"), sliced)
    never = [checkpoint.load_shard(str(tmp_path / "sliced"), i, 2, DenseSlicing.from_flag(-1, 2)) for i in range(2)]
    placed = {name: i for i, state in enumerate(never) for name in state.params}
    assert placed == {name: ps_for_variable(name, 2) for name in ("kernel", "bias", "scale")}
    np.testing.assert_array_equal(never[placed["kernel"]].params["kernel"], _model(3)["kernel"])


def test_a_checkpoint_missing_a_slice_is_damaged_and_says_which(tmp_path):
    cores = _cores(OPTIMIZERS["sgd"], 2, DenseSlicing.from_flag(0, 2), _model(0))
    states = [core._copy_locked() for core in cores]
    del states[1].params["kernel#slice-1-of-2"]
    for ps_id, state in enumerate(states):
        checkpoint.save_shard(str(tmp_path), ps_id, 2, state)
    with pytest.raises(DamagedCheckpointError, match=r"'kernel': slices \[1\] of 2 are missing"):
        checkpoint.load_shard(str(tmp_path), 0, 3, DenseSlicing.from_flag(0, 3))


def test_the_acceptance_shape_each_of_3_ps_holds_about_a_third():
    """A variable 4x the threshold on 3 PS: each holds a third of it (its slots too)."""
    rows = 1000
    model = {"big": np.zeros((rows, 1024), np.float32)}  # 4 MiB with a 1 MiB threshold
    layout = DenseSlicing.from_flag(1.0, 3)
    cores = _cores(OPTIMIZERS["adam"], 3, layout, model)
    held = [sum(v.nbytes for v in core.shard.params.values()) for core in cores]
    assert sum(held) == model["big"].nbytes
    assert max(held) - min(held) <= 1024 * 4  # one row apart
    assert all(abs(h - model["big"].nbytes / 3) < 0.01 * model["big"].nbytes for h in held)


def test_clipnorm_problem_names_the_sliced_variables_and_the_threshold_that_avoids_it():
    trainable = {"big": np.zeros((1000, 1024), np.float32), "small": np.zeros((4, 4), np.float32)}
    slicing = DenseSlicing.from_flag(1.0, 2)
    problem = clipnorm_problem(slicing, {"clipnorm": 1.0}, trainable)
    assert "cuts 1 variables (big)" in problem and "Raise --slice_dense_above_mb to 3.91 or more" in problem
    assert DenseSlicing.from_flag(3.91, 2).count((1000, 1024), trainable["big"].nbytes) == 1  # the way out works
    assert clipnorm_problem(slicing, {"clipnorm": None, "clipvalue": 1.0}, trainable) == ""
    assert clipnorm_problem(slicing, {"clipnorm": 0.0}, trainable) == ""  # Keras: off
    assert clipnorm_problem(DenseSlicing.from_flag(8.0, 2), {"clipnorm": 1.0}, trainable) == ""


class _Variable:
    """What with_slices_joined reads of a tf.Variable: its shape and its value."""

    def __init__(self, value):
        self.value = value
        self.shape = value.shape

    def numpy(self):
        return self.value


def test_a_variables_slices_are_joined_whole_and_some_of_them_written_into_a_copy():
    current = np.zeros((5, 2), np.float32)
    variables = {"w": _Variable(current), "b": _Variable(np.zeros(2, np.float32))}
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    both = with_slices_joined({"w#slice-0-of-2": rows[:3], "w#slice-1-of-2": rows[3:], "b": np.ones(2)}, variables.get)
    assert sorted(both) == ["b", "w"]
    np.testing.assert_array_equal(both["w"], rows)
    one = with_slices_joined({"w#slice-1-of-2": rows[3:]}, variables.get)
    np.testing.assert_array_equal(one["w"][3:], rows[3:])
    np.testing.assert_array_equal(one["w"][:3], 0)
    assert not np.shares_memory(one["w"], current)  # a copy: the model's variable changes only when assigned
    unknown = with_slices_joined({"v#slice-0-of-2": rows[:3]}, variables.get)
    assert list(unknown) == ["v#slice-0-of-2"]  # left for the caller to name
    with pytest.raises(SliceError, match=r"'w#slice-0-of-2' with shape \(2, 2\), which is not rows 0:3"):
        with_slices_joined({"w#slice-0-of-2": rows[:2]}, variables.get)


def test_a_sliced_shard_replicates_and_a_new_backup_catches_up_with_its_slices():
    """Shard 1 of 2 holds slice 1 of each variable (the non-trainable one too): its backup, and a
    backup made later from a snapshot, end equal to the primary bit for bit."""
    from elasticdl.ps.replica_snapshot import begin_catch_up
    from elasticdl.ps.replication import BackupApplier
    from elasticdl.rpc.batch_position import BatchPosition
    from tests.test_replication import adam, fingerprint, gradient, model, pair

    layout = DenseSlicing.from_flag(0, 2)

    def mine(arrays):
        return {n: v for n, v in layout.split(arrays).items() if ps_for_variable(n, 2) == 1}

    appliers: dict[int, BackupApplier] = {}
    primary, backup, first = pair(lambda ps, entry: appliers[ps].receive(entry), ps_id=1, num_ps=2, grads_to_wait=1)
    appliers[1] = first
    primary.push_model(mine(model()), 0, ["bn/moving_mean#slice-1-of-2"])
    assert sorted(primary.shard.params) == ["bn/moving_mean#slice-1-of-2", "dense/bias#slice-1-of-2",
                                            "dense/kernel#slice-1-of-2"]
    rng = np.random.default_rng(5)
    for step in range(6):
        primary.push_gradients(mine(gradient(rng)), primary.shard.version, None, batch=BatchPosition(1, 1, (step + 1) * 8, 8))
        assert fingerprint(backup) == fingerprint(primary)
    late = ParameterServer(PSSettings(ps_id=1, num_ps=2, grads_to_wait=1), adam())
    appliers[2] = BackupApplier(late, installed=False)
    seq, snapshot = begin_catch_up(primary, 2)
    appliers[2].install(seq, snapshot)
    primary.push_gradients(mine(gradient(rng)), primary.shard.version, None, batch=BatchPosition(2, 1, 8, 8))
    assert fingerprint(late) == fingerprint(primary) == fingerprint(backup)
    assert primary.shard.version == 7
