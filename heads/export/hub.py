"""Upload an exported folder to the Hugging Face Hub.

The token comes from huggingface_hub's usual places (HF_TOKEN, `hf auth login`); it is never read,
printed or logged here. The upload runs after the export is in place, so a failed push leaves the
export standing and says so in its one line.
"""

from __future__ import annotations

from pathlib import Path

from conf.errors import UserError, first_line

NO_TOKEN = "set HF_TOKEN or run `hf auth login` with a write token"


def push_folder(folder: str | Path, repo_id: str, private: bool = False) -> str:
    """Create the model repo if needed, upload every file of `folder`, return the commit URL."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, HTTPError

    kept = f"the export in {folder} is kept"
    if get_token() is None:  # the Hub would answer 401 only after a round trip, or not at all
        raise UserError(f"push_to_hub={repo_id}: no Hugging Face token; {NO_TOKEN} ({kept})")
    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            commit_message=f"draftsmith export of {Path(folder).name}",
        )
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "?"
        if status == 401:
            raise UserError(f"push_to_hub={repo_id}: not authorised; {NO_TOKEN} ({kept})") from None
        raise UserError(
            f"push_to_hub={repo_id}: the Hub refused the upload (HTTP {status}; {kept})"
        ) from None
    except (HTTPError, OSError) as err:  # no network, DNS, proxy, HF_HUB_OFFLINE=1
        raise UserError(
            f"push_to_hub={repo_id}: cannot reach the Hub ({first_line(err)}; {kept})"
        ) from None
    return info.commit_url
