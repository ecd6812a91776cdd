"""AlexNet's layout (``features -> avgpool -> classifier`` of 3 Linear layers) with a
classifier of 256 hidden features instead of 4096 (2.4M parameters instead of 57M) and no
dropout: ``-a small_alexnet:make`` for tests that need hybrid's split classifier, not its
size."""

from tandem.models.alexnet import alexnet


def make(num_classes, in_channels):
    return alexnet(num_classes, in_channels, dropout=0.0, hidden_features=256)
