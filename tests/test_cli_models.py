"""`tandem models`: the table as a subprocess, the way a user runs it; options and errors
in this process (the same ``main``, without a second start-up)."""

import json

from conftest import run_tandem

from tandem.cli.main import main
from tandem.models import list_models

PARAMS = {"alexnet": 61_100_840, "cifar_resnet20": 269_722, "resnet50": 25_557_032,
          "vgg16": 138_357_544, "alexnet_grouped": 60_965_224}


def tandem(*args):
    return run_tandem("models", *args, timeout=120)


def test_table_lists_every_model():
    proc = tandem()
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
    assert main(["models", "resnet9"]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("tandem: error: unknown model 'resnet9'")
    assert "cifar_resnet20" in err and len(err.strip().splitlines()) == 1
    assert main(["models", "vgg11", "--input-size", "16"]) == 2
    assert "at least 32x32" in capsys.readouterr().err
