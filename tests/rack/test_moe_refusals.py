"""A MoE batch the kernel refuses between two it takes: the step model never assumes that refusals
are monotone in tokens (tiny-gpt-oss on ``tiny``: the slot programs refuse 128 received tokens,
the gathering program takes 256)."""

from jalapeno_emu.rack.deployment import predict


def test_serving_a_tiny_model_where_the_slot_programs_refuse_a_batch_does_not_crash() -> None:
    p = predict("tiny-gpt-oss", "tiny", 128, 16, 2, finalists=1, disk_cache=False)
    assert p.as_dict()["tpot_s"] > 0
