"""The realistic models of bench_training, built in code (no downloads), with their synthetic data.

``resnet``: a ResNet-18 for CIFAR-shaped images (3x32x32, 10 classes): a 3x3 stem with no
max-pool, BasicBlocks [2, 2, 2, 2] of width w, 2w, 4w, 8w, BatchNorm, global average pool, a
linear classifier; at w = 64, 11.17M parameters in 62 tensors.
``gpt``: a GPT-2-style decoder: token and learned position embeddings, pre-LayerNorm blocks of
causal self-attention (torch's scaled_dot_product_attention) and a 4x GELU MLP, a final
LayerNorm, and an output head tied to the token embedding, as GPT-2 ties it (one tensor, whose
gradient sums the two uses).

Imported by training_worker.py only when one of these models runs (torch is imported here).
"""
import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm; a 1x1 projection on the shortcut when the shape
    changes."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet(width=64, classes=10, blocks=(2, 2, 2, 2)):
    """ResNet-18 as it is trained on CIFAR-10 (the stem keeps 32x32: no 7x7 and no max-pool)."""
    layers = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage, count in enumerate(blocks):
        cout = width << stage
        for i in range(count):
            layers.append(BasicBlock(cin, cout, 2 if stage and not i else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq, dim, heads, layers):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.apply(_gpt2_init)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions.weight[:ids.shape[1]]
        return F.linear(self.ln(self.blocks(x)), self.tokens.weight)   # the tied head


def _gpt2_init(module):
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases (LayerNorm keeps 1 and 0)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, 'bias', None) is not None:
            nn.init.zeros_(module.bias)


def build(name, size):
    """The model ``name`` with the constructor arguments of ``size`` (all but 'batch')."""
    kwargs = {k: v for k, v in size.items() if k != 'batch'}
    return resnet(**kwargs) if name == 'resnet' else GPT(**kwargs)


def batch(name, size, samples, gen):
    """(inputs, targets) of ``samples`` synthetic samples drawn from ``gen``: images with
    random labels, or random token sequences whose targets are the next tokens."""
    if name == 'resnet':
        return torch.randn(samples, 3, 32, 32, generator=gen), \
            torch.randint(0, 10, (samples,), generator=gen)
    ids = torch.randint(0, size['vocab'], (samples, size['seq'] + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
