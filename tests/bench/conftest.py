"""Fixtures of the bench's tests."""

import pytest


@pytest.fixture
def argparse_error(capsys):
    """``argparse_error(main, argv)``: what ``main(argv)`` printed to stderr, asserted to have ended it with
    argparse's exit status 2 (the status of its ``error:`` line), for the command lines' refusals."""

    def refused(main, argv):
        with pytest.raises(SystemExit) as done:
            main(argv)
        err = capsys.readouterr().err
        assert done.value.code == 2, err
        return err

    return refused
