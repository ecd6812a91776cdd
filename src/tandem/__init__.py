"""tandem: train convolutional networks on several devices at once.

Layers (data flows down; nothing imports upward)::

    cli -> train -> strategies -> parallel / hybrid / distributed -> models, data

Every strategy computes the same update as one device training on the whole batch.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
