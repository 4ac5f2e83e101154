"""Stage handler for the encoder (BERT-style) family: every stage of a model uses this file.

Which stage, which model folder and which compute mode come from the environment stack.yml sets
(QUART_MODEL_DIR, QUART_STAGE_INDEX, QUART_NUM_STAGES, QUART_COMPUTE); the parameters load once, when
the worker imports this module.
"""

from quart_stage.handler import StageHandler

handle = StageHandler.from_env(family="encoder")
