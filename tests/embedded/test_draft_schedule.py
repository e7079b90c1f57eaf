"""The draft-length schedule file: batch size -> draft length, read and written as YAML or JSON."""
import pytest

from autotune.embedded.draft_schedule import DraftSchedule


def test_a_step_takes_the_first_row_whose_bound_holds_its_batch_and_the_last_row_covers_the_rest(tmp_path):
    s = DraftSchedule(drafter="ngram", rows=[{"max_batch": 1, "draft_length": 8}, {"max_batch": 4, "draft_length": 4},
                                             {"max_batch": 8, "draft_length": 0}])
    assert [s.length_for(b) for b in (1, 2, 4, 5, 8, 64)] == [8, 4, 4, 0, 0, 0]
    assert s.max_draft_length == 8
    for name in ("s.yaml", "s.json"):
        assert DraftSchedule.load(s.dump(tmp_path / name)) == s


@pytest.mark.parametrize("text, names", [
    ("drafter: ngram\nrows: [{max_batch: 4, draft_length: 2}, {max_batch: 2, draft_length: 1}]", "increasing"),
    ("drafter: ngram\nrows: [{max_batch: 0, draft_length: 2}]", "rows.0.max_batch"),
    ("drafter: ngram\nrows: []", "rows"),
    ("drafter: ngram\nrows: [{max_batch: 2, draft_length: 2, k: 3}]", "rows.0.k"),
    ("rows: [{max_batch: 1, draft_length: 2", "draft schedule"),
])
def test_a_bad_schedule_file_is_one_line_naming_the_file_and_the_field(tmp_path, text, names):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        DraftSchedule.load(path)
    assert str(path) in str(e.value) and names in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="No such file"):
        DraftSchedule.load(tmp_path / "missing.yaml")
