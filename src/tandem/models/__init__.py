"""tandem.models: the model zoo.

``create_model(name, num_classes=None, **kw)`` builds a registered model; ``list_models()``
names them all. ImageNet: ``alexnet``, ``alexnet_grouped``, ``vgg11/13/16/19[_bn]``,
``resnet18/34/50/101/152``. CIFAR: ``cifar_resnet20/32/44/56/110`` (10 classes by default).
Every model takes ``in_channels`` (default 3). ResNets are assembled by
:class:`ResNetBuilder`; ``count_macs`` counts multiply-accumulates with forward hooks.
"""

from tandem.models.builder import ResNet, ResNetBuilder
from tandem.models.macs import count_macs, count_parameters, mac_breakdown
from tandem.models.registry import (
    ModelInfo,
    create_model,
    list_models,
    model_info,
    native_input_size,
    register_model,
)

__all__ = [
    "create_model",
    "list_models",
    "model_info",
    "native_input_size",
    "register_model",
    "ModelInfo",
    "ResNetBuilder",
    "ResNet",
    "count_macs",
    "mac_breakdown",
    "count_parameters",
]
