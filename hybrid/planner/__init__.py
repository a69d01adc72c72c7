"""Planner: hardware profile + model bytes + flags -> a placement Plan with predicted speed.

    mb = ModelBytes.from_folder(model_dir)              # safetensors headers only, no weights
    prof = load_profile("v100x2-e5v4")                  # profiles/NAME.json or a path
    plan = make_plan(mb, prof, PlanRequest(gpus=(0, 1), layer_split=(24,)))
    plan.cards[0].layers, plan.cards[0].slots, plan.prediction.tok_s
"""
from hybrid.planner.build import PlanRequest, make_plan
from hybrid.planner.model_bytes import ModelBytes
from hybrid.planner.plan import CardPlan, HostPlan, LayerPrediction, Plan, PlanInputs, Prediction
from hybrid.planner.popularity import Popularity, find_popularity, load_popularity
from hybrid.planner.profile import HardwareProfile, ProfileError, list_profiles, load_profile
from hybrid.planner.search import best_plan

__all__ = ["PlanRequest", "make_plan", "best_plan", "ModelBytes", "Plan", "PlanInputs", "CardPlan",
           "HostPlan", "Prediction", "LayerPrediction", "Popularity", "load_popularity",
           "find_popularity", "HardwareProfile", "ProfileError", "load_profile", "list_profiles"]
