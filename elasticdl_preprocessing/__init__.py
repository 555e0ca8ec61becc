"""Keras preprocessing layers under the names of the original ElasticDL's `elasticdl_preprocessing`
package, so that its model zoo (model_zoo/dac_ctr) imports them unedited.

Written anew from that package's documented semantics (docs/model_zoo.md, "Migrating from the
original ElasticDL"); the layers subclass whichever Keras `tf.keras` names in the process (tf_keras
under TF_USE_LEGACY_KERAS=1, else Keras 3), as the model that uses them does.
"""
