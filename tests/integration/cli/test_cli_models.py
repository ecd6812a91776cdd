"""`tandem models`: the table as a subprocess, the way a user runs it; options and errors
in this process (the same ``main``, without a second start-up)."""

import json

from conftest import run_tandem

from tandem.cli.main import main
from tandem.models import list_models

PARAMS = {"alexnet": 61_100_840, "cifar_resnet20": 269_722, "resnet50": 25_557_032,
          "vgg16": 138_357_544, "alexnet_grouped": 60_965_224}


def test_table_lists_every_model():
    proc = run_tandem("models", timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:-1]}
    assert sorted(rows) == sorted(list_models())
    for name, params in PARAMS.items():
        assert rows[name][1] == f"{params:,}"
    assert rows["resnet50"][2] == "4.089" and rows["resnet50"][3] == "224x224"
    assert rows["alexnet_grouped"][3] == "227x227"
    assert rows["cifar_resnet20"][3:] == ["32x32", "10"]


def test_json_and_options(capsys):
    assert main(["models", "cifar_resnet20", "alexnet", "--json", "--num-classes", "7",
                 "--input-size", "64"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in rows] == ["cifar_resnet20", "alexnet"]
    assert rows[0]["num_classes"] == 7 and rows[0]["input_size"] == 64
    assert rows[0]["params"] == 269_722 - 3 * 65  # 3 fewer outputs of a 64-input fc
    # cifar_resnet20 at 64x64 costs 4x its 32x32 count of 40,551,040 (minus the smaller fc)
    assert rows[0]["macs"] == 4 * (40_551_040 - 640) + 64 * 7


def test_errors_are_one_line(capsys):
    assert main(["models", "zzz"]) == 2  # nothing close to it: every name
    err = capsys.readouterr().err
    assert err.strip().startswith("tandem: error: unknown model 'zzz'")
    assert "cifar_resnet20" in err and len(err.strip().splitlines()) == 1
    assert main(["models", "vgg11", "--input-size", "16"]) == 2
    assert "at least 32x32" in capsys.readouterr().err


def test_a_mistyped_arch_gets_the_closest_names_wherever_a_flag_takes_one(tmp_path):
    """`train -a`, `eval -a`, `bench -a` and `models NAME`: one line, the closest names first
    (not all 20), and where to see them all; nothing is written."""
    import torch
    from conftest import run_in_process
    from tandem.models import create_model

    torch.save(create_model("cifar_resnet20").state_dict(), tmp_path / "plain.pt")
    out = tmp_path / "run"
    cases = [
        (("train", "-a", "resnt50", "--out", out), "resnet50?"),
        (("eval", "--resume", tmp_path / "plain.pt", "-a", "resnet_18"), "resnet18?"),
        (("bench", "-a", "cifar_resnet21", "--devices", "cpu"),
         "cifar_resnet20, cifar_resnet32 or cifar_resnet110?"),
        (("models", "vgg16bn"), "vgg16_bn?"),
    ]
    for argv, guess in cases:
        proc = run_in_process(*argv)
        err = proc.stderr.strip()
        assert proc.returncode == 2 and len(err.splitlines()) == 1, (argv, proc.stderr)
        assert f": did you mean {guess} (`tandem models`" in err, err
        assert "alexnet_grouped" not in err and "Traceback" not in err
    assert not out.exists()
