"""Dataset classes laid out as users lay them out, for tests/test_layouts.py.

Each dataset's batch says whether its worker has imported TensorFlow (`tf_flag`): no
layout here uses TensorFlow in its own code, so no worker should import it.
"""
