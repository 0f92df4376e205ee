"""The key/value cache of beam search (§6.1): each beam's keys and values written once, in its own slot.

`beam_search_vaswani.BeamSearch` decodes with it: attention writes through the `Cache` interface (`update`), and
the search masks each step with the mask `append_position` returns, which it passes to the decoder as its
attention mask. Reordering the beams after a step moves no keys or values, where transformers' `DynamicCache`
gathers the surviving beams' copies of the whole cache (docs/performance.md, "Beam search").
"""

import torch
from transformers.cache_utils import Cache, DynamicLayer


def _beam_search_cache_unsupported(*args, **kwargs) -> None:
    # What `BeamSearchCache` and its layers refuse: an edit that would leave the beams' ancestry and their slots apart.
    raise NotImplementedError(
        "BeamSearchCache serves `beam_search`: it appends positions, follows the beams through their ancestry "
        "(`reorder_cache`) and drops finished sentences; use a DynamicCache to reset, crop, repeat, select or "
        "reorder the rows of a cache, or to build attention masks from it."
    )


class BeamSearchCacheLayer(DynamicLayer):
    """One decoder layer's masked self-attention keys and values (§3.2.3) during beam search (§6.1).

    Each position's keys and values are written once, in the slot of the beam that produced them:
    buffers laid out `(batch, heads, capacity * num_beams, d_k)`, position-major, which grow to twice the
    length needed when full. `keys` and `values` are `(batch, heads, length * num_beams, d_k)` views of them, every slot
    of every position of a sentence, to which its beams attend as one query sequence, each masked to its
    own ancestors by the mask of `BeamSearchCache.append_position`. Reordering the beams thus moves no keys or
    values, where gathering the surviving beams' copies after every step would read and write the whole cache
    (docs/performance.md, "Beam search"). They are copied only when the buffers grow
    and when sentences leave the batch. Made for `BeamSearchCache`, which appends and drops sentences:
    reordering, cropping and repeating rows, and building masks from the layer, raise NotImplementedError.
    """

    is_croppable = False

    def __init__(self, num_beams: int) -> None:
        super().__init__()
        self.num_beams = num_beams

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate buffers for 32 positions, shaped after the first `(batch, heads, beams, d_k)` keys and values.

        See docs/performance.md, "The beam-search cache".
        """
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = 0
        self._buffers = tuple(self._allocate(states, capacity=32) for states in (key_states, value_states))
        self.is_initialized = True

    def _allocate(self, states: torch.Tensor, capacity: int) -> torch.Tensor:
        # states: `(batch, heads, ..., d)`, giving the batch, heads and d of the new buffer
        return states.new_empty(states.shape[0], states.shape[1], capacity * self.num_beams, states.shape[-1])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one position, `(batch, heads, num_beams, d_k)` keys and values (one per slot, or one for all).

        Returns:
            All keys and values, `(batch, heads, length * num_beams, d_k)`, position-major.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length * self.num_beams, (self.length + 1) * self.num_beams
        if end > self._buffers[0].shape[2]:
            grown = tuple(self._allocate(buffer, capacity=2 * self.length) for buffer in self._buffers)
            for new, old in zip(grown, self._buffers, strict=True):
                new[:, :, :start] = old
            self._buffers = grown
        for buffer, states in zip(self._buffers, (key_states, value_states), strict=True):
            buffer[:, :, start:end] = states
        self.length += 1
        self.keys, self.values = (buffer[:, :, :end] for buffer in self._buffers)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Positions held, not slots: `keys` has `num_beams` slots per position (docs/performance.md)."""
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sentences `indices` `(new_batch,)`, in that order.

        See docs/performance.md, "Finished sentences leave the batch".
        """
        if self.is_initialized:
            indices = indices.to(self.device)
            self._buffers = tuple(buffer.index_select(0, indices) for buffer in self._buffers)
            self.keys, self.values = (buffer[:, :, : self.length * self.num_beams] for buffer in self._buffers)

    reorder_cache = crop = batch_repeat_interleave = get_mask_sizes = _beam_search_cache_unsupported


class BeamSearchCache(Cache):
    """The masked self-attention cache of `beam_search`: one `BeamSearchCacheLayer` per decoder layer.

    It keeps each beam's ancestry: `ancestry[sentence, beam, position]`, `(batch, beams, length)`, is the
    slot in which that beam's hypothesis wrote its keys and values for the position. Beam i of a sentence
    may attend to the slot of its ancestry at each position and to no other (§3.2.3: a position attends
    to the positions up to and including it, here of its own hypothesis); that is the mask `append_position`
    returns, `(batch, 1, beams, length * num_beams)`, True where attending is allowed, the SDPA format, made once
    per step for every layer. `beams` is the rows per sentence of the step: 1 or num_beams at the first one.

    Only `update`, `reorder_cache` and the length queries are supported: resetting, cropping, repeating or
    selecting rows through the `Cache` interface would leave the ancestry behind, and raise NotImplementedError.

    Args:
        num_layers: decoder layers.
        batch_size: sentences.
        num_beams: slots per position.
        rows_per_sentence: decoder rows per sentence at the first step (1 or num_beams).
        device: where the ancestry and the mask are made (the decoder input's device); the attention
            moves the mask to each layer's device.
    """

    def __init__(
        self, num_layers: int, batch_size: int, num_beams: int, rows_per_sentence: int, device: torch.device
    ) -> None:
        super().__init__(layers=[BeamSearchCacheLayer(num_beams) for _ in range(num_layers)])
        self.num_beams = num_beams
        self.ancestry = torch.empty(batch_size, rows_per_sentence, 0, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        """Sentences still in the batch (docs/performance.md, "Finished sentences leave the batch")."""
        return self.ancestry.shape[0]

    def append_position(self) -> torch.Tensor:
        """Give the next position a slot in every beam's ancestry, and return the mask of its attention (§3.2.3).

        Called once per step, before the decoder runs: each beam writes the new position into its own slot (with one
        row per sentence, slot 0 stands for all, which the layers fill alike). See docs/performance.md, "The
        beam-search cache".

        Returns:
            `(batch, 1, beams, (length + 1) * num_beams)` booleans, True where a beam may attend: the slots of its
            own ancestry, the new position's included.
        """
        batch, beams, _ = self.ancestry.shape
        slots = torch.arange(beams, device=self.ancestry.device).expand(batch, beams)
        self.ancestry = torch.cat((self.ancestry, slots[..., None]), dim=2)
        all_slots = torch.arange(self.num_beams, device=self.ancestry.device)
        return (self.ancestry[..., None] == all_slots).flatten(2)[:, None]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Go on with row `beam_idx[i]` of the last step as row i, `(new_batch * num_beams,)`.

        The rows are numbered sentence by sentence, `beams` each, and those of a sentence stay together.
        A sentence none of whose rows go on leaves the batch: its keys and values go, which copies the
        others' (the only copy besides the buffers' growth).

        See docs/performance.md, "The beam-search cache".
        """
        batch, beams, length = self.ancestry.shape
        sentences = beam_idx[:: self.num_beams] // beams
        if sentences.shape[0] != batch:
            for layer in self.layers:
                layer.batch_select_indices(sentences)
        self.ancestry = self.ancestry.view(batch * beams, length)[beam_idx].view(-1, self.num_beams, length)

    reset = crop = batch_repeat_interleave = batch_select_indices = _beam_search_cache_unsupported
