"""--eod-mask-loss masks the positions whose input is the end-of-document id, as Megatron-DeepSpeed does: the
prediction across a document boundary leaves the loss, the prediction of the id stays in it. Checked against
Megatron-DeepSpeed's get_ltor_masks_and_position_ids (its loss-mask and position part, transcribed below) in
training's and evaluation's get_batch, DeepSpeed-Ulysses' slices and the pipeline's batches."""
import torch

from megatron.pipeline_training import PipelineBatches
from megatron.training import get_batch

EOD = 50
CPU = torch.device("cpu")
# two samples of seq_length + 1 tokens: documents 11 12 13 <eod>, 21 22 ... and one that starts with <eod>
TEXT = torch.tensor([[11, 12, 13, EOD, 21, 22, 23, EOD, 31],
                     [EOD, 41, 42, 43, 44, EOD, EOD, 51, 52]])


def mds_loss_mask_and_positions(data, eod_token, eod_mask_loss):
    """Megatron-DeepSpeed's megatron/utils.py get_ltor_masks_and_position_ids, called by its pretrain_gpt.py
    get_batch with the input tokens, at its defaults reset_position_ids = reset_attention_mask = False."""
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(data.size(1), dtype=torch.long, device=data.device)
    return loss_mask, position_ids.unsqueeze(0).expand_as(data)


def test_the_mask_leaves_out_the_prediction_after_each_eod_not_the_prediction_of_it():
    tokens, labels, positions, mask = get_batch({"text": TEXT}, CPU, EOD, eod_mask_loss=True)
    assert mask[0].tolist() == [1, 1, 1, 0, 1, 1, 1, 0]  # 13 -> <eod> trained, <eod> -> 21 not
    assert mask[1].tolist() == [0, 1, 1, 1, 1, 0, 0, 1]
    expected_mask, expected_positions = mds_loss_mask_and_positions(TEXT[:, :-1], EOD, True)
    assert torch.equal(mask, expected_mask) and torch.equal(positions, expected_positions)
    assert torch.equal(tokens, TEXT[:, :-1]) and torch.equal(labels, TEXT[:, 1:])


def test_without_the_flag_every_position_is_trained():
    _, _, positions, mask = get_batch({"text": TEXT}, CPU, EOD, eod_mask_loss=False)
    expected_mask, expected_positions = mds_loss_mask_and_positions(TEXT[:, :-1], EOD, False)
    assert torch.equal(mask, expected_mask) and mask.sum() == mask.numel()
    assert torch.equal(positions, expected_positions)  # positions never restart at a document boundary


def test_each_ulysses_rank_gets_its_slice_of_the_whole_sequence_mask():
    whole, _ = mds_loss_mask_and_positions(TEXT[:, :-1], EOD, True)
    for rank in range(2):
        group = type("Group", (), {"rank": rank, "size": 2})
        _, _, positions, mask = get_batch({"text": TEXT}, CPU, EOD, eod_mask_loss=True, sequence=group)
        assert torch.equal(mask, whole[:, 4 * rank:4 * rank + 4])
        assert positions[0].tolist() == list(range(4 * rank, 4 * rank + 4))


def test_the_pipeline_batches_carry_the_same_mask():
    (tokens, positions), (labels, mask) = next(PipelineBatches(iter([{"text": TEXT}]), CPU, EOD, True))
    expected_mask, expected_positions = mds_loss_mask_and_positions(TEXT[:, :-1], EOD, True)
    assert torch.equal(mask, expected_mask) and torch.equal(positions, expected_positions)
    assert torch.equal(labels, TEXT[:, 1:])
