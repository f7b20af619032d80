"""Upload an exported folder to the Hugging Face Hub.

The token comes from huggingface_hub's usual places (HF_TOKEN, `hf auth login`); it is never read,
printed or logged here.
"""

from __future__ import annotations

from pathlib import Path

from conf.errors import UserError

NO_TOKEN = "set HF_TOKEN or run `hf auth login` with a write token"


def push_folder(folder: str | Path, repo_id: str, private: bool = False) -> str:
    """Create the model repo if needed, upload every file of `folder`, return the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            commit_message=f"draftsmith export of {Path(folder).name}",
        )
    except LocalTokenNotFoundError:
        raise UserError(f"push_to_hub={repo_id}: {NO_TOKEN}") from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "?"
        if status == 401:
            raise UserError(f"push_to_hub={repo_id}: not authorised; {NO_TOKEN}") from None
        raise UserError(
            f"push_to_hub={repo_id}: the Hub refused the upload (HTTP {status})"
        ) from None
    return info.commit_url
