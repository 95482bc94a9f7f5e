"""The map keys besides a decoder layer's int index: :class:`LayerPartKey` for a token mixer run inside a decoder
layer besides its main one, :class:`SharedAttentionKey` for Zamba2's shared attention block; both sort in execution
order next to the int keys."""
from __future__ import annotations

import torch


class LayerPartKey(str):
    """The map key of a token mixer run inside decoder layer ``layer`` besides the one under the int key ``layer``:
    the string ``"{layer}.{part}"``, ordered just after the int key ``layer`` (so ``sorted(maps)`` is execution
    order, next to the int keys of the other layers). Inkling's convolution after the MLP (``"{i}.mlp_sconv"``,
    Inkling2's ``"{i}.post_mlp_convolution"``). Equal to, and hashed as, the plain string."""

    ORDER = 2  # relative to the int key of the same layer (1)

    def __new__(cls, layer: int, part: str, position: int = 0):
        key = super().__new__(cls, f"{layer}.{part}")
        key.layer, key.part, key.position = int(layer), str(part), int(position)
        return key

    def __getnewargs__(self):  # pickle / deepcopy rebuild it from the layer index, the part and its position
        return (self.layer, self.part, self.position)

    @staticmethod
    def _rank(key):
        # ``position``: the part's place among its layer's mixers in execution order (EfficientViM's dwconv1, mixer,
        # dwconv2: the names alone would sort dwconv2 before the mixer)
        if isinstance(key, LayerPartKey):
            return (key.layer, key.ORDER, key.position, key.part)
        if isinstance(key, int) and not isinstance(key, bool):
            return (key, 1, 0, "")
        return None

    def _compare(self, other, op):
        ranks = self._rank(self), self._rank(other)
        if ranks[1] is None:
            return getattr(str(self), op)(other)
        return getattr(ranks[0], op)(ranks[1])

    def __lt__(self, other):
        return self._compare(other, "__lt__")

    def __le__(self, other):
        return self._compare(other, "__le__")

    def __gt__(self, other):
        return self._compare(other, "__gt__")

    def __ge__(self, other):
        return self._compare(other, "__ge__")

    __hash__ = str.__hash__
    __eq__ = str.__eq__
    __ne__ = str.__ne__


class SharedAttentionKey(LayerPartKey):
    """The map key of Zamba2's shared attention block run inside decoder layer ``i``: the string
    ``"{i}.shared_attention"``, ordered just before the int key ``i`` (so ``sorted(maps)`` is execution order,
    next to the int keys of the other layers). Equal to, and hashed as, the plain string."""

    ORDER = 0

    def __new__(cls, layer: int):
        return super().__new__(cls, layer, "shared_attention")

    def __getnewargs__(self):  # pickle / deepcopy rebuild it from the layer index
        return (self.layer,)


# Named where users meet them (mamba_captum.attention re-exports them): pickles and torch.save files name the class
# by its module, so maps saved before the keys moved here load, and type(key) reads as it always did.
LayerPartKey.__module__ = SharedAttentionKey.__module__ = "mamba_captum.attention"

# Maps saved with torch.save load back under torch.load's default weights_only=True.
torch.serialization.add_safe_globals([SharedAttentionKey, LayerPartKey])
