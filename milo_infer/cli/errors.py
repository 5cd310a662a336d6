"""The errors that describe the user's input or environment, not a bug: `milo` prints them as one line
on stderr and exits 2, with no traceback. Apart from `main` so that a subcommand's own entry point
(`python -m milo_infer.cli.bench`) reports them the same way without importing `main`."""
from milo_store.codecs.allocation import BudgetError
from milo_store.errors import StoreError
from milo_store.staging import StagingError

from ..building.config import BuildError
from ..tasks.corpus import CorpusError
from ..tasks.datasets import DatasetUnavailable
from ..building.distributed import RankError
from ..models import ModelUnavailable, UnsupportedModelError
from ..runtime.errors import BlockLoadError, RequestError
from . import CommandError

INPUT_ERRORS = (CommandError, BuildError, BudgetError, CorpusError, DatasetUnavailable, ModelUnavailable,
                UnsupportedModelError, StoreError, StagingError, RankError, BlockLoadError, RequestError)
