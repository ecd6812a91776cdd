"""tandem.models: the model zoo (AlexNet, VGG and ResNet for ImageNet, ResNets for CIFAR).

``create_model(name, num_classes=None, **kw)`` builds a registered model; ``list_models()``
names them all.
"""

from tandem.models.builder import ResNet, ResNetBuilder
from tandem.models.macs import count_macs, count_parameters, mac_breakdown
from tandem.models.registry import (ModelInfo, create_model, list_models, model_info,
                                    native_input_size, register_model)

# the built-in models: importing their modules registers them (@register_model)
from tandem.models import alexnet, cifar_resnet, resnet, vgg  # noqa: F401

__all__ = ["create_model", "list_models", "model_info", "register_model"]
