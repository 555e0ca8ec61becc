"""Keras hooks ElasticDL does not run: a model that overrides them is refused at submit, never
silently trained otherwise.

A worker computes ``loss(labels, model(features, training=True))`` plus ``model.losses`` in a
tape of its own and pushes the gradients; the parameter servers apply them with the module's
``optimizer()``. Evaluation runs ``model(features, training=False)`` into ``eval_metrics_fn()``,
prediction ``model(features, training=False)``. So a model's own ``train_step`` (or the
``compute_loss`` that Keras's default train_step calls), ``test_step`` and ``predict_step`` are
never called: a GAN's two optimizers, a custom gradient treatment, a loss built inside the step
would all be lost without a word. Running ``train_step`` faithfully would need its optimizer to
stand for the parameter servers' and its metrics to merge across workers: not done.
"""

from __future__ import annotations

from typing import Any

from elasticdl.model.spec import ModelSpecError

# command -> the hooks that command would skip
_HOOKS = {
    "train": ("train_step", "compute_loss"),
    "evaluate": ("test_step",),
    "predict": ("predict_step",),
}

_WHAT_RUNS = {
    "train_step": "a worker computes the gradients of loss(labels, model(features, training=True)) plus "
                  "model.losses, and the parameter servers apply them with optimizer()",
    "compute_loss": "the loss is the module's loss(labels, predictions) plus model.losses",
    "test_step": "evaluation computes eval_metrics_fn()'s metrics on model(features, training=False)",
    "predict_step": "prediction writes model(features, training=False)",
}

_WHAT_TO_DO = {
    "train_step": "Move what it computes into the module: the loss into loss(labels, predictions) (the model's "
                  "extra losses into self.add_loss), the metrics into eval_metrics_fn(); or train this model "
                  "with model.fit",
    "compute_loss": "Move it into the module's loss(labels, predictions) (the model's extra losses into "
                    "self.add_loss)",
    "test_step": "Compute what it computes in eval_metrics_fn()'s metrics (functions of labels and predictions)",
    "predict_step": "Return what it returns from call(), or post-process the predictions in a "
                    "PredictionOutputsProcessor",
}


def overridden_hooks(model: Any, command: str) -> list[str]:
    """The hooks of ``command`` that ``model``'s class overrides (Keras 3 or Keras 2)."""
    from elasticdl.model.keras_generation import keras_module

    base = keras_module().Model
    found = []
    for hook in _HOOKS.get(command, ()):
        mine, keras_own = getattr(type(model), hook, None), getattr(base, hook, None)
        if mine is not None and keras_own is not None and mine is not keras_own:
            found.append(hook)
    return found


def check_hooks(model: Any, command: str, module_path: str, model_name: str) -> None:
    """ModelSpecError naming the first hook the command would skip, what runs instead and the fix."""
    hooks = overridden_hooks(model, command)
    if not hooks:
        return
    hook = hooks[0]
    owner = next((c.__name__ for c in type(model).__mro__ if hook in vars(c)), type(model).__name__)
    raise ModelSpecError(
        f"{module_path}: {model_name}() returns a {type(model).__name__}, whose class {owner} overrides "
        f"{hook}(), which ElasticDL does not run: {_WHAT_RUNS[hook]}, so what {hook}() does differently "
        f"would be silently lost. {_WHAT_TO_DO[hook]}."
    )
