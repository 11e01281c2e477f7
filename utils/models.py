"""The model every script trains: ResNet-18 for 32x32 images."""
import torchvision
from torch import nn

ARCH = "resnet18-cifar"


def resnet18_cifar(num_classes: int = 100) -> nn.Module:
    """torchvision's ResNet-18 with num_classes outputs (CIFAR-100's 100 by default) and the usual CIFAR
    stem: a 3x3 stride-1 first convolution and no max-pool, so 32x32 inputs keep their resolution into the
    first stage (ImageNet's stem would shrink them to 8x8)."""
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits
    model.maxpool = nn.Identity()
    return model
