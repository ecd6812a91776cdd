"""StopRequest: the first Ctrl-C is a request, a second one stops at once, but never inside a
critical section (a checkpoint write), which always completes first."""

import os
import signal
import time

import pytest

from tandem.train.interrupt import StopRequest


def press_ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # let the main thread run the Python-level handler


def test_first_press_is_a_request_second_raises(capsys):
    before = signal.getsignal(signal.SIGINT)  # ignored when pytest runs in the background
    with StopRequest() as stop:
        press_ctrl_c()
        assert stop.requested
        assert "stopping after this step" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            press_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is before


def test_critical_section_completes_before_the_second_press_raises():
    finished = []
    with StopRequest() as stop:
        press_ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            with stop.critical():
                press_ctrl_c()  # would cut a checkpoint write short
                finished.append(True)
    assert finished == [True]


def test_disabled_changes_nothing():
    before = signal.getsignal(signal.SIGINT)
    with StopRequest(enabled=False) as stop:
        assert signal.getsignal(signal.SIGINT) is before
        with stop.critical():
            pass
    assert not stop.requested
