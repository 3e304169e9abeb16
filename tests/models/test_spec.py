"""models/spec.py: what of a library's exception an error quotes."""

from trt_pipeline.models.spec import first_line, first_lines


def test_an_exceptions_lines_are_quoted_without_terminal_colours():
    """torch.export colours its message for a terminal: the codes would be quoted into the error as escapes."""
    error = RuntimeError("Failed to export the model. \x1b[96mThis is step 1/3\x1b[0m of exporting.\nNext steps")
    assert first_line(error) == "Failed to export the model. This is step 1/3 of exporting."
    assert first_lines(error) == "Failed to export the model. This is step 1/3 of exporting. | Next steps"
