"""tandem: train convolutional networks on several devices at once.

Layers (data flows down; nothing imports upward)::

    cli -> train -> strategies -> parallel / hybrid / distributed -> models, data -> keyed

Every strategy computes the same update as one device training on the whole batch.
``tandem.fit(model, train_data, val_data, **settings)`` trains a model of your own
(:mod:`tandem.api`).
"""

from tandem.version import __version__

__all__ = ["__version__", "fit", "exit"]


def __getattr__(name: str):
    # ``tandem.fit`` and ``tandem.exit`` are imported on first use: `import tandem` (and
    # `tandem --version`) stay light, without torch.
    if name == "fit":
        from tandem.api import fit

        return fit
    if name == "exit":
        from tandem.distributed.process_group import exit_process

        return exit_process
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
