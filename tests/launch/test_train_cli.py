"""`qwentitan-launch train` refuses bad input in one sentence, exit code 2, before starting ranks."""

from qwentitan.launch import cli
from qwentitan.launch.platforms import current_platform


def refused(capsys, *argv):
    assert cli.main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    message = err.strip()
    assert message.startswith("qwentitan-launch train: ") and "\n" not in message
    return message.removeprefix("qwentitan-launch train: ")


def test_unknown_recipe(capsys):
    message = refused(capsys, "--recipe", "tiny_gpt")
    assert (
        message == "Unknown recipe 'tiny_gpt'; choose one of qwen3_4b_hf, qwen3_4b_native, "
        "qwen3_moe_kernels, tiny_dense, tiny_hf, tiny_moe, tiny_moe_kernels."
    )


def test_missing_dataset_path(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    message = refused(capsys, "--dataset", str(missing), "--run-dir", str(tmp_path))
    assert message.startswith(f"Dataset path {missing} does not exist;")


def test_sequence_length_the_model_cannot_take(capsys, tmp_path):
    message = refused(capsys, "--seq-len", "1000000", "--run-dir", str(tmp_path))
    assert "--seq-len 1000000 is longer than the model's" in message


def test_more_ranks_than_the_machine_holds(capsys, tmp_path):
    too_many = current_platform().max_ranks + 1
    message = refused(capsys, "--ranks", str(too_many), "--run-dir", str(tmp_path))
    assert message.startswith(f"--ranks {too_many} is more than this cpu host holds")


def test_resume_without_a_checkpoint(capsys, tmp_path):
    message = refused(capsys, "--resume", "--run-dir", str(tmp_path))
    assert message.startswith("There is no checkpoint to resume in ")
