"""End to end: digits trains as well with its dense tensors in bfloat16 on the wire (--wire_dtype)."""

from __future__ import annotations

from tests.test_e2e_local import digits, elasticdl, report_of, train_args  # noqa: F401 (digits: a fixture)


def test_digits_reaches_the_usual_accuracy_with_bfloat16_on_the_wire(digits, tmp_path):  # noqa: F811
    report = report_of(elasticdl(
        train_args(digits, "digits.digits_functional.custom_model", num_workers=1, num_ps=1,
                   wire_dtype="bfloat16", job_name="bf16"),
        cwd=tmp_path,
    ))
    assert report["metrics"]["accuracy"] >= 0.90
    assert report["records_trained"] == 3 * 1437
    assert report["dropped_tasks"] == 0
    log = (tmp_path / "runs" / "bf16" / "logs" / "worker-0.log").read_text()
    assert "wire_dtype=bfloat16" in log  # the worker said what its tensors travel as
