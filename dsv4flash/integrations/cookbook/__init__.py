"""tinker-cookbook over the built-in tasks: dataset builders for the cookbook's own supervised and RL loops.

The cookbook's `supervised.train.main` / `rl.train.main` take a `dataset_builder` (a chz config object) and a
`model_name` (the base to train and the tokenizer to load). Pointed at `dsv4flash serve`, `model_name` is the
Hugging Face directory the server serves for its base (listed by `get_server_capabilities`; the cookbook's
`get_tokenizer` loads a local directory with `AutoTokenizer`), and these builders supply the data from
`dsv4flash.tasks` instead of hub datasets: no download, no chat renderer (the task data is encoded as the local
engine does, bos + text with the task tokenizer's ids; the served tokenizer also encodes any other text, with chat
markup, for the cookbook's renderers). Imported on use only; the core never imports it. See docs/service.md.
"""

from dsv4flash.integrations.cookbook.rl import TaskEnv, TaskEnvGroupBuilder, TaskRLDataset, TaskRLDatasetBuilder
from dsv4flash.integrations.cookbook.supervised import TaskSupervisedDataset, TaskSupervisedDatasetBuilder

__all__ = ["TaskEnv", "TaskEnvGroupBuilder", "TaskRLDataset", "TaskRLDatasetBuilder", "TaskSupervisedDataset",
           "TaskSupervisedDatasetBuilder"]
