"""`pagedattn.benchmarks.tree_commit`: the one answer to "which commit is this tree" that every
benchmark and GPU script records."""

from __future__ import annotations

import subprocess

import pytest

from pagedattn.benchmarks import COMMIT_ENV, tree_commit


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A checkout of one commit holding `a.txt`; no PAGEDATTN_COMMIT, no outer git variables."""
    for name in (COMMIT_ENV, "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        monkeypatch.delenv(name, raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_a_clean_tree_is_its_short_head_and_untracked_files_do_not_count(repo):
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert tree_commit(repo) == head
    (repo / "new.txt").write_text("untracked\n")
    assert tree_commit(repo) == head


def test_a_changed_tracked_file_marks_it_dirty(repo):
    (repo / "a.txt").write_text("two\n")
    assert tree_commit(repo) == _git(repo, "rev-parse", "--short", "HEAD") + "-dirty"


def test_the_variable_wins_over_git(repo, monkeypatch):
    (repo / "a.txt").write_text("two\n")  # a stale .git beside a changed tree
    monkeypatch.setenv(COMMIT_ENV, " abc1234 ")
    assert tree_commit(repo) == "abc1234"
    monkeypatch.setenv(COMMIT_ENV, "")  # empty: not given
    assert tree_commit(repo).endswith("-dirty")


def test_unknown_without_a_checkout_or_git(repo, tmp_path_factory, monkeypatch):
    assert tree_commit(tmp_path_factory.mktemp("plain")) == "unknown"
    (repo / "sub").mkdir()
    assert tree_commit(repo / "sub") == "unknown"  # inside another checkout: not this tree's commit
    monkeypatch.setenv("PATH", "")
    assert tree_commit(repo) == "unknown"
