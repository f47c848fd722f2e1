"""Agents: what a session can run, with each agent's tools (schemas, policies) and default model."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..control.catalog import AgentDescription
from .auth import Require
from .deps import HostDep
from .problems import not_found, problem_responses
from .schemas import AgentList

router = APIRouter(prefix="/v1/agents", tags=["agents"])


@router.get(
    "",
    operation_id="listAgents",
    response_model=AgentList,
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_agents(host: HostDep) -> AgentList:
    """The registered agents by name: each one's description, tools (name, description, JSON schema of the
    arguments, policies) and the model its sessions use by default (provider, model and profile names; never an
    endpoint or a credential). An agent's MCP tools are those its servers list (cached by each server)."""
    return AgentList(items=await host.catalog.all())


@router.get(
    "/{name}",
    operation_id="getAgent",
    response_model=AgentDescription,
    responses=problem_responses(404),
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_agent(name: str, host: HostDep) -> AgentDescription:
    """One agent, described as in the list."""
    if name not in host.registry:
        raise not_found("agent", name)
    return await host.catalog.describe(name)
