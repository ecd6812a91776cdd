"""An error names its parameters; str() says their names, the command line their flags
(tandem.cli.common.error_line), word for word the line it printed before."""

import pickle

from tandem.cli.common import error_line, flag_for
from tandem.errors import TandemError, UsageError, first_line, param


def test_a_message_says_the_names_and_the_command_line_the_flags():
    exc = UsageError(f"bad {param('weight_decay')} -1.0: must be >= 0; see {param('lr')}")
    assert str(exc) == exc.args[0] == "bad weight_decay -1.0: must be >= 0; see lr"
    assert exc.params == ("weight_decay", "lr")
    assert error_line(exc) == "bad --weight-decay -1.0: must be >= 0; see --lr"
    assert first_line(exc) == str(exc)


def test_flag_for_takes_the_field_s_own_flag_else_the_name_s():
    assert flag_for("lr") == "--lr"                      # not --learning-rate
    assert flag_for("weight_decay") == "--weight-decay"  # not --wd
    assert flag_for("batch_size") == "--batch-size"      # not -b
    assert flag_for("pretrained") == "--pretrained"      # not --weights
    assert flag_for("nproc_per_node") == "--nproc-per-node"  # no config field: the name's


def test_a_message_without_parameters_is_left_as_it_is():
    plain = UsageError("no {braces} are read: {'a': 1}")
    assert plain.params == () and error_line(plain) == str(plain) == "no {braces} are read: {'a': 1}"
    other = TandemError(3, quiet=True)  # not a message: kept as given
    assert other.args == (3,) and other.quiet and error_line(other) == "3"


def test_the_command_line_says_one_line_and_a_pickled_error_keeps_its_parameters():
    exc = UsageError(f"bad {param('lr')} 0:\nsecond line")
    assert error_line(exc) == "bad --lr 0:"
    again = pickle.loads(pickle.dumps(exc))  # as from a worker process
    assert str(again) == str(exc) and again.params == ("lr",)
    assert error_line(again) == "bad --lr 0:"


def test_negative_control_a_flag_written_in_the_message_is_not_a_parameter():
    wrong = UsageError("bad --lr 0")
    assert wrong.params == () and error_line(wrong) == str(wrong) == "bad --lr 0"
