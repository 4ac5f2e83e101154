"""Sentence-embedding head: mean pooling over the tokens, then L2 normalisation (sentence-transformers').

`SentenceBert` is the whole model of the ``bert-sentence`` layer plan (`quart_stage.families.PLANS`):
BERT's embeddings and blocks under the names BertForMaskedLM uses (``bert.embeddings``,
``bert.encoder.layer``; a plain BertModel checkpoint such as all-MiniLM-L6-v2's matches them with the
``bert.`` prefix dropped), no pooler, and a parameter-free ``pooling`` head. The stage holding the head
answers one unit-length embedding per text (batch × hidden); cosine similarity is then a dot product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertModel, BertPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

from quart_stage.ragged import Segments


class MeanPooling(nn.Module):
    """sentence-transformers' ``Pooling(pooling_mode_mean_tokens=True)`` followed by ``Normalize()``.

    ``takes_mask``: the stage forward passes the padding mask (batch × sequence, 1 = token); padded
    positions are left out of the mean, so a padded batch gives each text its unpadded embedding; a packed row
    (:class:`quart_stage.ragged.Segments`) gives one mean per sequence.
    """

    takes_mask = True

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | Segments | None = None) -> torch.Tensor:
        if isinstance(mask, Segments):
            pooled = torch.cat([part.mean(dim=1) for part in mask.split(hidden, 1)], dim=0)
        elif mask is None:
            pooled = hidden.mean(dim=1)
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


class SentenceBert(BertPreTrainedModel):
    """The whole sentence-embedding model: ``forward(input_ids, attention_mask)`` -> an output whose
    ``logits`` are the normalised embeddings (the name every stage chain's last tensor has)."""

    def __init__(self, config):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.pooling = MeanPooling()
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids).last_hidden_state
        return SequenceClassifierOutput(logits=self.pooling(hidden, attention_mask))
