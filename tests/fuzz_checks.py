"""Schemathesis checks for the fuzz test (the CLI loads this file through SCHEMATHESIS_HOOKS)."""

import schemathesis


def is_server_error(status: int, text: str) -> bool:
    """A 5xx, or a 200 stream that carries an engine failure (a 5xx in all but status)."""
    return status >= 500 or (status == 200 and '"server_error"' in text)


@schemathesis.check
def no_server_error_in_stream(ctx, response, case):
    if is_server_error(response.status_code, response.text) and response.status_code < 500:
        raise AssertionError(f"server error inside a 200 response: {response.text[:300]}")
