"""Every command that writes refuses, in one sentence and before any work, a place it could not write (the
result of a long run is never lost at the end); and a flag the command would ignore is refused too."""

import pytest

from labkit.cli import main


@pytest.mark.parametrize(
    "argv, says",
    [
        (["doctor", "--skip-smoke", "--json", "{dir}"], "--json {dir} is a folder"),
        (["doctor", "--skip-smoke", "--json", "{dir}/no/such/report.json"], "does not exist"),
        (["slides", "--out", "{file}"], "--out {file} is a file"),
        (["slides", "--out", "{dir}/decks", "--timeout", "30"], "which only --execute starts"),
        (["slides", "--out", "{dir}/decks", "--execute", "--timeout", "nan"], "--timeout must be a positive"),
        (["release", "--student", "{file}/course"], "is a file, not a folder"),
    ],
)
def test_an_output_that_cannot_be_written_or_an_ignored_flag_is_one_line_and_exit_2(
    tmp_path, capsys, argv, says
):
    file = tmp_path / "notes.txt"
    file.write_text("not a folder")
    argv = [a.format(dir=tmp_path, file=file) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says.format(dir=tmp_path, file=file) in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing was written


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--bogus", "-m", "labkit", "budget"], "unrecognized arguments: --bogus"),
        (["--nnodes", "0", "-m", "labkit", "budget"], "--nnodes 0 is not a node count"),
        (
            ["--nproc-per-node", "abc", "-m", "labkit", "budget"],
            "--nproc-per-node abc is not a number of ranks",
        ),
    ],
)
def test_torchruns_own_bad_arguments_are_one_line_and_exit_2(monkeypatch, capsys, argv, says):
    from labkit.cli import torchrun

    monkeypatch.setenv(torchrun._CALLER_CPP_LEVEL, "")  # as in the agent's own interpreter: parse here
    assert main(["torchrun", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err, err
