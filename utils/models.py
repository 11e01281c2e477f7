"""ResNet-18 for 32x32 images, and the optimiser and schedule every script trains it with."""
import torch
import torchvision
from torch import nn

from utils import techniques

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


def sgd_with_cosine(model: nn.Module, args, optimizer_class=torch.optim.SGD, cuda_graphs: bool = False):
    """SGD with momentum and weight decay, learning rate on a cosine from --lr to 0 over the epochs (after
    --warmup-epochs rising linearly from --lr/100), stepped once per epoch with scheduler.step(), the
    non-deprecated form; --optimizer-impl picks torch's for-loop, foreach or fused implementation (auto, under
    `cuda_graphs`: fused). Reads the flags of utils.flags.add_training_flags and --optimizer-impl."""
    impl = techniques.optimizer_options(args.optimizer_impl, optimizer_class, cuda_graphs)
    optimizer = optimizer_class(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, **impl)
    warmup = args.warmup_epochs
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - warmup)
    if not warmup:
        return optimizer, cosine
    rising = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup)
    return optimizer, torch.optim.lr_scheduler.SequentialLR(optimizer, [rising, cosine], milestones=[warmup])
