"""A small ResNet-style CNN (He et al. 2016): a 3x3 stem, two stages of BasicBlocks with BatchNorm and in-place
ReLU (the second stage downsamples with a strided 1x1 projection), global average pooling and a linear classifier,
for 32x32 RGB images and 10 classes.

Model-file convention: `build_model()` and `sample_batch(batch_size)`; targets are class ids, so the default loss
is cross-entropy.
"""
from __future__ import annotations

import torch
import torch.nn as nn

IMAGE_SIZE, CLASSES = 32, 10
"""Input resolution and number of classes."""


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, width: int = 16, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width),
                                    BasicBlock(2 * width, 2 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model() -> ResNet:
    """The model, freshly initialised."""
    return ResNet()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (batch_size, 3, 32, 32) and class ids (batch_size,)."""
    return torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE), torch.randint(0, CLASSES, (batch_size,))
